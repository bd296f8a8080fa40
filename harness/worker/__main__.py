"""``python -m harness.worker``: one benchmark cell's process (:mod:`harness.worker.worker`)."""

from harness.worker.worker import main

main()
