"""Reading GGUF headers without loading a model: for plugins that describe models (the
Ollama API's /api/show, a model browser). Long arrays (vocabularies, merges) come back as
``{"array_of": n}``; a file that is not GGUF raises :class:`GGUFError`. ``find_projector(model)``
is the projector (mmproj) beside a model file, ``projector_capabilities(path)`` what it adds."""

from localm.kernel.gguf import (FILE_TYPES, PROJECTOR_ARCHITECTURE, GGUFError, architecture, find_projector,
                                header, metadata, projector_capabilities, tensor_names, tensor_shapes)

__all__ = ["FILE_TYPES", "PROJECTOR_ARCHITECTURE", "GGUFError", "architecture", "find_projector", "header",
           "metadata", "projector_capabilities", "tensor_names", "tensor_shapes"]
