"""The embedded default model's files (package data, not code): see README.md here."""
