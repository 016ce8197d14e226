#!/usr/bin/env bash
# The checks that need a GPU, in one run of under 8 minutes on one H200: bash tools/gpu_check.sh
#
# It installs nothing (the GPU machine may have no network): it runs this checkout from its root with
# the python3 that holds torch, Triton and transformers (PYTHON=... to choose another). Each part runs
# under its own timeout; a part that fails or times out is recorded and the next one runs. Everything
# goes to one results file, $OUT/gpu_check.txt if OUT is set, else ./gpu-results/gpu_check.txt; the
# exit status is the number of parts that did not pass.
#
# Parts:
#   kernels   compiled kernel tests: TRITON_INTERPRET=0 pytest tests/test_kernels.py tests/test_engine_triton.py
#   engine    the engine on the Triton backend against the torch backend and transformers (float32, greedy),
#             with swap, the host prefix tier and parallel samples; bfloat16 agreement; synchronizations per step
#   bench-kernels   kvlib bench kernels (decode bandwidth against the device's peak)
#   bench-swap      kvlib bench swap --device cuda with a Llama-3-8B-shaped block
#   bench-engine    kvlib bench engine with decode graphs against without (--compare-graphs)
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
RESULTS_DIR="${OUT:-$PWD/gpu-results}"
mkdir -p "$RESULTS_DIR"
RESULTS="$RESULTS_DIR/gpu_check.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
KVLIB=("$PY" -c 'import sys; from kvlib.cli.commands import main; sys.exit(main(sys.argv[1:]))')
failed=0
: >"$RESULTS"

note() { printf '%s\n' "$@" | tee -a "$RESULTS"; }

part() {  # part NAME SECONDS COMMAND...: run it under a timeout, its output into the results file
    local name=$1 limit=$2 start rc
    shift 2
    note "" "==== $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" >>"$RESULTS" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ]; then
        note "==== $name: passed in $(($(date +%s) - start))s"
    else
        failed=$((failed + 1))
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && rc="$rc (timed out)"
        note "==== $name: FAILED, exit status $rc, after $(($(date +%s) - start))s"
    fi
}

note "kvlib GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$RESULTS" 2>&1
"$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' >>"$RESULTS" 2>&1

part kernels 240 "$PY" -m pytest tests/test_kernels.py tests/test_engine_triton.py -q -p no:cacheprovider -x \
    -o addopts="" --durations=5

part engine 150 "$PY" - <<'EOF'
"""Greedy tokens on the GPU: Triton backend = torch backend = transformers in float32, also under swap and the
host prefix tier; bfloat16 agreement between the backends; device synchronizations per decode step."""
import sys
import warnings

import torch
import transformers

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.model.default import default_model_path
from kvlib.tokenizer import Tokenizer

PROMPTS = ["The with statement", "A dictionary is a mapping", "Exceptions are raised when", "import os",
           "The for loop iterates over the items of any sequence"]
greedy = SamplingParams(max_tokens=32, ignore_eos=True)
problems = []


def tokens(backend, dtype, **config):
    llm = LLM("default", EngineConfig(attention_backend=backend, dtype=dtype, **{"num_gpu_blocks": 512, **config}),
              verbose=False)
    outs = llm.generate(PROMPTS, greedy)
    return [o.token_ids for o in outs], llm


hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).cuda().eval()
tok = Tokenizer.from_folder(default_model_path())
expected = []
for prompt in PROMPTS:
    ids = torch.tensor([tok.encode(prompt)], device="cuda")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                      do_sample=False, pad_token_id=0)
    expected.append(out[0, ids.shape[1]:].tolist())
for backend in ("triton", "torch"):
    got, llm = tokens(backend, "float32")
    print(f"float32 {backend}: graphs {llm.engine.runner.graphs is not None}, equal to transformers: {got == expected}")
    if got != expected:
        problems.append(f"float32 {backend} differs from transformers")
pressured, llm = tokens("triton", "float32", num_gpu_blocks=12, num_cpu_blocks=64, preemption_mode="swap",
                        watermark=0.0, enable_prefix_caching=True, host_prefix_cache=True)
m = llm.metrics
print(f"float32 triton, 12 blocks, swap + host prefix tier: {m.num_preemptions} preemptions, "
      f"{m.num_swapped_out_blocks} blocks out, {m.num_swapped_in_blocks} in; equal to transformers: {pressured == expected}")
if pressured != expected or m.num_swapped_out_blocks == 0:
    problems.append("swap on the GPU changed tokens (or did not swap)")
sampled = SamplingParams(max_tokens=16, n=3, temperature=1.0, seed=7)
runs = [[[s.token_ids for s in o.samples] for o in LLM("default", EngineConfig(attention_backend=b, dtype="float32",
        num_gpu_blocks=512), verbose=False).generate(PROMPTS, sampled)] for b in ("triton", "torch")]
print(f"float32 seeded samples, n=3 (copy-on-write): equal across backends: {runs[0] == runs[1]}")
if runs[0] != runs[1]:
    problems.append("seeded samples differ between backends")
bf16 = [tokens(b, "bfloat16")[0] for b in ("triton", "torch")]
same = sum(a == b for x, y in zip(*bf16) for a, b in zip(x, y))
print(f"bfloat16: {same} of {sum(map(len, bf16[0]))} greedy tokens equal between the backends (rounding differs)")

llm = LLM("default", EngineConfig(gpu_memory_utilization=0.3), verbose=False)  # pool sized by the memory profile
print(f"pool sized from free memory after profiling the largest step: {llm.engine.runner.gpu_pool.num_blocks:,} blocks, "
      f"{llm.engine.runner.gpu_pool.data.nbytes / 2**30:.2f} GiB; dtype {llm.engine.dtype}")
llm.generate(PROMPTS, SamplingParams(max_tokens=2))
engine, steps, syncs = llm.engine, 0, []
for i, prompt in enumerate(PROMPTS):
    engine.add_request(f"s{i}", prompt, greedy)
engine.step()  # the prefill
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
torch.cuda.set_sync_debug_mode("default")
messages = sorted({str(w.message).splitlines()[0] for w in caught})
print(f"decode steps: {steps}, synchronizing calls: {len(caught)} ({len(caught) / max(steps, 1):.1f} per step; "
      f"1 is reading the sampled tokens back)")
for message in messages[:5]:
    print("   ", message)
print("problems:", problems or "none")
sys.exit(1 if problems else 0)
EOF

part bench-kernels 90 "${KVLIB[@]}" bench kernels
part bench-swap 90 "${KVLIB[@]}" bench swap --device cuda --model llama-3-8b --total-mib 256 --repeats 7
part bench-engine 180 "${KVLIB[@]}" bench engine --compare-graphs --requests 256 --scale 0.5 --budget 65536

note "" "==== $failed part(s) did not pass; results in $RESULTS"
exit "$failed"
