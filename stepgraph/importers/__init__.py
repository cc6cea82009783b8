"""Importers: model specs from other projects' configs (Hugging Face ``config.json``)."""
