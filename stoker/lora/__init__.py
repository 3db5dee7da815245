"""Multi-LoRA serving: PEFT adapters applied on top of any projection's weight method."""
