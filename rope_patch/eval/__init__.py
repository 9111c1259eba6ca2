"""Evaluation at extended lengths: a methods sweep over one loaded model (:mod:`.sweep`), perplexity
(:mod:`.perplexity`), passkey retrieval (:mod:`.passkey`), their reports and plots, and resumable result files
(:mod:`.store`). The jobs that run them from the command line are in :mod:`rope_patch.jobs`."""
