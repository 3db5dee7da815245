"""The model repository: the --config file of the models one server serves."""
