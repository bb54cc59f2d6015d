"""Which architectures are encoders (they embed or score text; they do not generate): one list for the
loader, which builds them, and the store, which labels a model's capabilities. No torch here."""
from __future__ import annotations

# GGUF ``general.architecture`` values of encoder models
ENCODER_GGUF_ARCHS = frozenset({"bert", "nomic-bert", "jina-bert-v2", "xlm-roberta"})
# Hugging Face ``architectures`` entries of encoder models (the ...ForSequenceClassification ones score)
ENCODER_HF_ARCHS = frozenset({"BertModel", "BertForMaskedLM", "BertForSequenceClassification", "XLMRobertaModel",
                              "RobertaModel", "NomicBertModel"})
