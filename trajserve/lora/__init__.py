"""LoRA adapters on the served base model (inference-optimization 8.2.1).

    adapter.py   read a PEFT adapter directory, check it against the base model's shapes
"""
