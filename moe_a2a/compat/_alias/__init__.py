"""A directory for `PYTHONPATH`, put there only by `python -m moe_a2a.compat.launch` (the opt-in): it
holds a `deep_ep` package that resolves to `moe_a2a.compat.deep_ep`. Nothing imports it otherwise."""
