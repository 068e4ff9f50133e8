"""Stand-in for sgl_kernel so sglang's CPU path imports on a machine without the real kernels.

SpecRollout's SGLang CPU test rig (rigs/sglang_cpu/build.sh installs it). sglang imports a few
names from sgl_kernel on CPU without a fallback; they exist here and raise NotImplementedError
if called. No ``torch.ops.sgl_kernel`` operator is registered, so sglang's CPU code falls back
to plain torch. Any other name is missing (AttributeError, i.e. ImportError for ``from``
imports), so sglang's own try/except fallbacks still apply.
"""


def _missing(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU test rig's stand-in "
                                  f"(no compiled sgl_kernel); this SGLang feature needs the real kernels")
    kernel.__name__ = name
    return kernel


# names sglang 0.5.23's CPU path imports without a fallback (found by importing sglang's engine,
# scheduler and model runner with SGLANG_USE_CPU_ENGINE=1 until no ImportError was left)
NAMES = (
    "copy_all_layer_kv_cache_cpu",              # kernels/ops/kvcache/cache_move.py
    "assign_req_to_token_pool_cpu",             # srt/mem_cache/allocation.py
    "build_tree_kernel_efficient_cpu",          # kernels/ops/speculative/spec_tree.py
    "verify_tree_greedy_cpu",                   # kernels/ops/speculative/spec_tree.py
    "assign_draft_cache_locs_contiguous_cpu",   # speculative cache helpers
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)
for _n in NAMES:
    globals()[_n] = _missing(_n)
