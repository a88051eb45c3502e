"""The pure core: API models, the TPU table, sizing, the job submission, the phase
transitions and the folding of trainer events. No I/O: it never imports kopf, kubernetes
or ray (an import-linter contract, run by the tests, says so)."""
