"""`shoal bench ...`: each command compares shoal with its peers in one run
and prints the figures side by side (plus JSON under bench_results/)."""
