"""inferflow plugin: redact personal data from requests before tokenization."""

from inferflow_pii_redactor.redactor import ENTITIES, PIIRedactor

__all__ = ["ENTITIES", "PIIRedactor"]
