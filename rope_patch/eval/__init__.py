"""Evaluation at extended lengths: a methods sweep over one loaded model (``sweep``), perplexity
(``perplexity``), passkey retrieval (``passkey``), their reports and plots, and resumable result files
(``store``). The jobs that run them from the command line are in ``rope_patch.jobs``."""
