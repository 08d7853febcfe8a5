"""The DP step sync: per-step exchange of counts, the StepPlan, the DP buffer service and its
gathers."""
