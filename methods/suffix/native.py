"""arctic-inference's compressed C++ suffix tree behind the trie's operations (``backend: native``,
the ``native`` extra), imported lazily: ``native_available`` says whether it imports here."""
from __future__ import annotations

from array import array
from typing import Sequence

from methods.suffix.speculation import NO_SPECULATION, Speculation

SENTINEL = -2  # never a token: prepended so the native tree also tries the whole context as a match
_FORCE = 1024.0  # factor that gives only one match length a positive native budget (exact in float32)
_NATIVE_CLASS = None


def _native_class():
    global _NATIVE_CLASS
    if _NATIVE_CLASS is None:
        try:  # the module's location moved between releases
            from arctic_inference.suffix_decoding._C import SuffixTree
        except ImportError:
            from arctic_inference.suffix_decoding import SuffixTree
        _NATIVE_CLASS = SuffixTree
    return _NATIVE_CLASS


def native_available() -> bool:
    """True where arctic-inference's native suffix tree imports (the ``native`` extra)."""
    try:
        _native_class()
    except ImportError:
        return False
    return True



class NativeSuffixTree:
    """The trie's operations on ``arctic_inference``'s compressed C++ suffix tree (optional).

    Imported lazily; raises ImportError where the package is missing. Same counts as SuffixTrie,
    but its children sit in a hash map, so ties between equal counts may be broken differently.

    Its ``speculate`` is SuffixDecoding's best-score rule over match lengths, on a context given
    as tokens; it stops one match length short of the context (as released). ``speculate_seq``
    drafts for a sequence inside the tree with every match length up to its whole length (the
    Python trie's ``own_matches`` rule) by prepending a SENTINEL token that never matches.
    ``speculate_at`` drafts from one match length only (budget forcing), which is how the
    first-hit rule runs on top of it.

    Pickling: the C++ tree cannot be pickled, and its tie-breaking depends on the hash maps'
    history, so the state is the log of every extend/remove call (a flat array of (seq id,
    token count) runs and one of the tokens), and unpickling replays it call by call into a new
    tree: later drafts equal the original's. The
    log is compacted at a ``remove`` once it holds more than twice the live tokens: the tree is
    then rebuilt from its live sequences in insertion order, which a replay reproduces too.
    """

    REMOVE = -3  # log marker: the sequence in the seq column was removed

    def __init__(self, max_depth: int = 64):
        self._tree = _native_class()(max_depth)
        self.max_depth = max_depth
        self._seqs: dict[int, list[int]] = {}
        self._log_run = array("q")  # (seq_id, n tokens of log_tok) per extend call; n = REMOVE: removed
        self._log_tok = array("i")
        self._live_tokens = 0
        self.version = 0

    # ----- the SuffixTrie interface the drafters use -----
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id]

    def sequence_length(self, seq_id: int) -> int:
        return len(self._seqs[seq_id])

    def sequence_tail(self, seq_id: int, n: int) -> list[int]:
        """The last ``n`` tokens of a sequence (a new list): a context's suffixes, without copying it all."""
        return self._seqs[seq_id][-n:] if n > 0 else []

    @property
    def num_nodes(self) -> int:
        return 0  # compressed: nodes are not comparable with the trie's; see approx_bytes

    def approx_bytes(self) -> int:
        return int(self._tree.estimate_memory()) + 4 * len(self._log_tok) + 8 * len(self._log_run) + 8 * self._live_tokens

    def append(self, seq_id: int, token: int) -> None:
        self.extend(seq_id, (token,))

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        if type(tokens) is not list:
            tokens = list(tokens)
        self._tree.extend(seq_id, tokens)
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
        seq += tokens
        self._live_tokens += len(tokens)
        self._log_tok.extend(tokens)
        run = self._log_run
        run.append(seq_id)
        run.append(len(tokens))
        self.version += 1

    def remove(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._tree.remove(seq_id)
        self._live_tokens -= len(seq)
        self._log_run.append(seq_id)
        self._log_run.append(self.REMOVE)
        self.version += 1
        if len(self._log_tok) > 2 * self._live_tokens + 4096:
            self._rebuild()

    def _rebuild(self) -> None:
        """A fresh tree of the live sequences, in insertion order; the log becomes just that."""
        seqs = self._seqs
        self._tree = _native_class()(self.max_depth)
        self._seqs, self._live_tokens = {}, 0
        self._log_run, self._log_tok = array("q"), array("i")
        version = self.version
        for seq_id, tokens in seqs.items():
            self.extend(seq_id, tokens)
        self.version = version

    def __getstate__(self) -> dict:
        return {"max_depth": self.max_depth, "log_run": self._log_run, "log_tok": self._log_tok,
                "version": self.version}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_depth"])
        log_tok = state["log_tok"]
        if "log_run" in state:
            run, pos = state["log_run"], 0
            for i in range(0, len(run), 2):
                seq_id, n = run[i], run[i + 1]
                if n == self.REMOVE:
                    self.remove(seq_id)
                else:
                    self.extend(seq_id, log_tok[pos:pos + n])
                    pos += n
        else:  # pickled before the run-length log: one seq id per token, REMOVE in the token column
            log_seq, n, i = state["log_seq"], len(log_tok), 0
            while i < n:  # runs of one sequence are one extend call
                seq_id, j = log_seq[i], i
                if log_tok[i] == self.REMOVE:
                    self.remove(seq_id)
                    i += 1
                    continue
                while j < n and log_seq[j] == seq_id and log_tok[j] != self.REMOVE:
                    j += 1
                self.extend(seq_id, log_tok[i:j])
                i = j
        self.version = state["version"]

    # ----- drafting -----
    def speculate(self, context: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                  offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """The native call as released: match lengths 1 .. len(context) - 1, best score wins
        (ties to the longer match)."""
        d = self._tree.speculate(context if isinstance(context, list) else list(context),
                                 max_spec_tokens, factor, offset, min_prob, tree)
        tokens = d.token_ids
        if not tokens:
            return NO_SPECULATION
        return Speculation(tokens, d.parents if tree else None, d.score, d.match_len)

    def speculate_seq(self, seq_id: int, max_spec_tokens: int, factor: float = 1.0, offset: float = 0.0,
                      min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """``SuffixTrie.speculate(own_matches(seq_id), ...)``: every suffix of the sequence up to
        ``max_depth`` tokens is a candidate match."""
        return self.speculate_context(self._seqs[seq_id], max_spec_tokens, factor, offset, min_prob, tree)

    def speculate_context(self, context: Sequence[int], max_spec_tokens: int, factor: float = 1.0,
                          offset: float = 0.0, min_prob: float = 0.1, tree: bool = False) -> Speculation:
        """``SuffixTrie.speculate(match(context), ...)``: suffixes of up to ``max_depth`` tokens."""
        pattern = [SENTINEL]
        pattern += context[-self.max_depth:]
        return self.speculate(pattern, max_spec_tokens, factor, offset, min_prob, tree)

    def speculate_at(self, context: Sequence[int], m: int, max_spec_tokens: int,
                     min_prob: float) -> Speculation:
        """The path draft from the length-``m`` suffix of ``context`` alone (empty if it never
        occurred): every shorter match length gets a native budget of 0."""
        pattern = [SENTINEL]
        pattern += context[len(context) - m:]
        d = self._tree.speculate(pattern, max_spec_tokens, _FORCE, 0.5 * _FORCE - _FORCE * m, min_prob, False)
        tokens = d.token_ids
        if not tokens:
            return NO_SPECULATION
        return Speculation(tokens, None, d.score, m)

    def speculate_first_hit(self, context: Sequence[int], window: int, min_match: int,
                            max_spec_tokens: int, min_prob: float) -> Speculation:
        """``SuffixTrie.speculate_first_hit`` on the native tree: per match length, one forced
        call, and where it drafts nothing a second with min_prob 0 tells "no continuation" (try
        a shorter pattern) from "cut by min_prob" (the hit stands, with an empty draft)."""
        n = len(context)
        for m in range(min(window, n, self.max_depth - 1), min_match - 1, -1):
            spec = self.speculate_at(context, m, max_spec_tokens, min_prob)
            if spec.token_ids:
                return spec
            if min_prob > 0 and self.speculate_at(context, m, 1, 0.0).token_ids:
                return Speculation([], None, 0.0, m)
        return NO_SPECULATION

