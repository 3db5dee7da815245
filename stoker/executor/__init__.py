"""Where an engine's steps run: the executor contract and its in-process and tensor-parallel
executors, with the process machinery (launch, worker loop, headless nodes) they need."""
