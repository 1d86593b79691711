"""inferflow plugin: redact personal data from requests before tokenization and from the
generated text after the engine."""

from inferflow_pii_redactor.redactor import ENTITIES, PIIOutputRedactor, PIIRedactor

__all__ = ["ENTITIES", "PIIOutputRedactor", "PIIRedactor"]
