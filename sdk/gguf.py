"""Reading GGUF headers without loading a model: for plugins that describe models (the
Ollama API's /api/show, a model browser). Long arrays (vocabularies, merges) come back as
``{"array_of": n}``; a file that is not GGUF raises :class:`GGUFError`."""

from localm.kernel.gguf import FILE_TYPES, GGUFError, header, metadata

__all__ = ["FILE_TYPES", "GGUFError", "header", "metadata"]
