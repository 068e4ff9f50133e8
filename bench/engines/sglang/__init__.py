"""The SGLang engine adapter (SGLang imported only when an engine is built): ``adapter``, with the
prefix path's scoring requests in ``scoring`` and a rollout being assembled in ``partial``."""
