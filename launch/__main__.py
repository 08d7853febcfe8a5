"""``python -m launch ...``: the dp-runtime CLI without the console script.

The entry point of ``ray job submit --working-dir . -- python -m launch run ...``: the job runs
in the uploaded copy of the repository, where the ``dp-runtime`` script may not be installed.
"""

from launch.cli import main

main()
