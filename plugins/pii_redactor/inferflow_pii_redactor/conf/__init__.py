"""Hydra config groups of the PII redactor plugin (``stages/pii_redactor``)."""
