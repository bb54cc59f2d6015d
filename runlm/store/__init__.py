"""The model store: names, content-addressed blobs, refs and the sources models come from."""
from runlm.store.names import InvalidNameError, ModelName
from runlm.store.store import ModelNotFoundError, ModelStore, NameConflictError, StoredModel, default_home

__all__ = ["InvalidNameError", "ModelName", "ModelNotFoundError", "ModelStore", "NameConflictError", "StoredModel",
           "default_home"]
