"""Fine-tuning pieces: the accelerate loop (``loop``), LoRA (``lora``), checkpoints and the final model
(``checkpoints``), and the training log (``log``). The job that assembles them is
``rope_patch.jobs.finetune``."""
