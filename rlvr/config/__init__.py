"""The configuration: its sections as frozen dataclasses with a docstring per field (schema.py; the algo section
and presets in algo.py; DiLoCo's in diloco.py), their checks, the field docs, and the memory plan behind rlvr plan."""
