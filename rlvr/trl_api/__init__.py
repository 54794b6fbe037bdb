"""What the TRL-shaped Python API (rlvr/api.py) makes of a TRL user's objects and fields: dataset rows, reward
functions, tools and environments named for config.yaml (inputs.py); TRL fields checked and mapped (checks.py)."""
