"""Fine-tuning pieces: the accelerate loop (:mod:`.loop`), LoRA (:mod:`.lora`), checkpoints and the final model
(:mod:`.checkpoints`), and the training log (:mod:`.log`). The job that assembles them is
:mod:`rope_patch.jobs.finetune`."""
