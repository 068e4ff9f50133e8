"""The SGLang engine adapter (SGLang imported only when an engine is built)."""
