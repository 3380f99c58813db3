#!/usr/bin/env bash
# One command for a GPU machine: what CI (which has no GPU) cannot check, run and recorded.
#
#   bash scripts/gpu-check.sh                   # every part, under ~9 minutes
#   bash scripts/gpu-check.sh --only simulate-2.5b,hook-vs-torch
#   bash scripts/gpu-check.sh --time-scale 3    # every time limit 3x (or GPU_CHECK_TIME_SCALE=3)
#   bash scripts/gpu-check.sh --dry-run         # the parts and their commands; runs nothing
#
# The parts: one compression round's cost on gpt2-345m (float32) and gpt2-2.5b (bf16)
# (benchmarks/round_cost.py), the CUDA tests (every test marked `cuda`), bf16 DDP and HSDP training over NCCL
# with the EDGC hook through `edgc train`, torchtitan's trainer with edgc (2 GPUs or more),
# our hook against torch's powerSGD_hook
# (benchmarks/hook_vs_torch.py --device cuda) and `edgc simulate --device cuda
# --save-profile`. Each runs under its own time limit, and a failing part does not stop the
# next one. Everything goes into benchmarks/results/<gpu>-<YYYYMMDD>/gpu-check/ ($OUT/... when
# $OUT is set, as on the lent GPU runner, which returns only what is written under $OUT):
# README.md (each command, its exit status and time, and the device), the logs, the run
# folders' summaries and metrics (not their checkpoints), the simulate reports and profiles.
# docs/developing.md ("On a lent GPU") says how to run it through the runner.
#
# Unlike the other scripts it installs nothing: a lent GPU machine has no network. It uses
# $GPU_CHECK_PYTHON, else .venv/bin/python, else python3, with this checkout's src/ first on
# PYTHONPATH, so that the code under test is this checkout's whatever the python has installed.
#
# Exit status: 0 when every part passed; 1 when one failed, timed out or was not reached
# within the time budget; 2 when nothing could run (no python with torch, no CUDA GPU, a bad
# option), and then nothing is written.

set -uo pipefail # no -e: a failing part is recorded, and the next one still runs

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Time limits in seconds, all scaled by --time-scale. The parts' limits add up to a little
# more than the budget: each is a ceiling for a hung part, and a part that works takes well
# under it; the budget keeps the whole under the GPU runner's 10 minutes a command.
BUDGET_S=540    # all parts together; a part gets at most what is left of it
MIN_PART_S=20   # a part is not started with less than this left
KILL_AFTER_S=15 # after its limit a part gets SIGTERM, and this long later SIGKILL

usage() {
    cat <<'EOF'
usage: bash scripts/gpu-check.sh [--only PART,...] [--time-scale N] [--dry-run] [--list]

Run the GPU checks and write benchmarks/results/<gpu>-<YYYYMMDD>/gpu-check/ (under $OUT
when it is set). Exits 2 at once, writing nothing, where torch sees no CUDA GPU.

  --only PART,...   run these parts only (--list names them)
  --time-scale N    multiply every time limit and the budget by N (default:
                    $GPU_CHECK_TIME_SCALE, else 1; the default budget is 540 s)
  --dry-run         print each part's name, time limit and command, tab-separated,
                    as on a machine with $GPU_CHECK_GPUS GPUs (default 1); runs nothing
  --list            print the parts' names and exit
EOF
}

PARTS="round-cost-345m round-cost-2.5b cuda-tests ddp-nccl ddp-shared-gpu hsdp-nccl torchtitan hook-vs-torch simulate-2.5b simulate-12.1b"

say() { printf 'gpu-check: %s\n' "$*"; }
die() { printf 'gpu-check: %s\n' "$*" >&2; exit 2; }

# gpu_short_name NAME: the folder name's GPU part, e.g. "NVIDIA H100 80GB HBM3" -> h100,
# "NVIDIA A100-SXM4-80GB" -> a100, "NVIDIA GeForce RTX 4090" -> rtx4090.
gpu_short_name() {
    local word words kept=()
    read -ra words <<<"${1//[-_\/()]/ }"
    for word in "${words[@]}"; do
        word=${word,,}
        case $word in nvidia | tesla | geforce | quadro | amd | radeon | instinct | graphics) continue ;; esac
        # the model's name is the first word of letters then digits (h100, a100, mi300x, l40s)
        if [[ $word =~ ^[a-z]+[0-9]+[a-z]*$ ]]; then
            printf '%s\n' "$word"
            return
        fi
        kept+=("${word//[^a-z0-9]/}")
    done
    # none such (RTX 4090): the first two words of what is left, run together
    local name="${kept[*]:0:2}"
    name=${name// /}
    printf '%s\n' "${name:-gpu}"
}

# find_python: the interpreter to use, as a user would pick it.
find_python() {
    if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then
        printf '%s\n' "$GPU_CHECK_PYTHON"
    elif [[ -x $ROOT/.venv/bin/python ]]; then
        printf '%s\n' .venv/bin/python
    elif command -v python3 >/dev/null; then
        printf '%s\n' python3
    fi
}

# probe_python PY: what the interpreter has, as KEY=VALUE lines (read by read_probe). Never
# fails: an import error is reported as error=...
probe_python() {
    "$1" - 2>&1 <<'EOF'
import importlib.util, os, platform, sys
print(f"python={platform.python_version()}")
print(f"executable={sys.executable}")
print(f"cpus={os.cpu_count()}")
try:
    import torch
except Exception as exc:
    print(f"error=torch is not importable: {type(exc).__name__}: {exc}".splitlines()[0])
    sys.exit(0)
print(f"torch={torch.__version__}")
print(f"cuda_build={torch.version.cuda}")
ok = torch.cuda.is_available()
print(f"cuda_available={int(ok)}")
if ok:
    print(f"gpus={torch.cuda.device_count()}")
    print(f"gpu_name={torch.cuda.get_device_name(0)}")
    print(f"gpu_memory_gib={torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}")
    print(f"bf16={int(torch.cuda.is_bf16_supported())}")
    print(f"cudnn={torch.backends.cudnn.version()}")
    try:
        print("nccl=" + ".".join(map(str, torch.cuda.nccl.version())))
    except Exception:
        print("nccl=none")
try:
    import edgc
    from edgc.extras import missing_modules
    print(f"edgc={edgc.__version__}")
    core = [m for m in ("numpy",) if importlib.util.find_spec(m) is None]  # (with torch: edgc's own needs)
    print(f"missing={' '.join(core + missing_modules('train'))}")
except Exception as exc:
    print(f"edgc_error={type(exc).__name__}: {exc}".splitlines()[0])
print(f"pytest={int(importlib.util.find_spec('pytest') is not None)}")
EOF
}

declare -A PROBE=()
read_probe() {
    local key value
    while IFS='=' read -r key value; do
        [[ $key =~ ^[a-z_0-9]+$ ]] && PROBE[$key]=$value
    done <<<"$1"
}

# --- the results, one entry per part, in the order run --------------------------------

R_NAME=() R_STATUS=() R_EXIT=() R_SECS=() R_LIMIT=() R_CMD=() R_LOG=() R_WHAT=()
INTERRUPTED=0
CHILD=""

record() { # record NAME STATUS EXIT SECS LIMIT CMD LOG WHAT
    R_NAME+=("$1") R_STATUS+=("$2") R_EXIT+=("$3") R_SECS+=("$4") R_LIMIT+=("$5")
    R_CMD+=("$6") R_LOG+=("$7") R_WHAT+=("$8")
}

selected() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }

scaled() { awk -v s="$1" -v k="$SCALE" 'BEGIN { printf "%d", s * k + 0.5 }'; }

# shown TEXT: a command or path as the README gives it: the results folder by its place in
# the repository, the scratch folder as <tmp>.
shown() {
    local text=${1//"$RES"/$RES_SHOWN}
    printf '%s' "${text//"$WORK"/<tmp>}"
}

# part NAME LIMIT WHAT CMD...: run one part under its time limit (scaled, and at most what is
# left of the budget), its output into its log (logs/NAME.log, or $LOG_AS under the results
# folder), and record it. $CHECK, when set, names a function that reads the log of a part
# that exited 0 and prints why it did not do its job, if it did not. Returns 0 when it passed.
part() {
    local name=$1 limit what=$3 cmd
    limit=$(scaled "$2")
    shift 3
    selected "$name" || return 1
    cmd=$(printf '%q ' "$@")
    cmd=${cmd% }
    if ((DRY_RUN)); then
        printf '%s\t%s\t%s\n' "$name" "$limit" "$cmd"
        return 1
    fi
    local log="$RES/${LOG_AS:-logs/$name.log}" left=$((BUDGET - SECONDS)) min_part
    min_part=$(scaled "$MIN_PART_S")
    if ((INTERRUPTED)); then
        record "$name" "not run: interrupted" "" "" "$limit" "$cmd" "" "$what"
        return 1
    fi
    if ((left < min_part)); then
        record "$name" "not run: the time budget was spent" "" "" "$limit" "$cmd" "" "$what"
        say "$name: not run, ${left} s of the budget left (--time-scale gives more)"
        return 1
    fi
    ((limit > left)) && limit=$left
    mkdir -p "$(dirname "$log")"
    say "$name (limit ${limit} s): $(shown "$cmd")"
    local start=$SECONDS status
    # In the background and waited for, so that a signal to this script reaches its trap at
    # once (on_signal stops the part); timeout signals the part's whole process group.
    timeout --kill-after="$KILL_AFTER_S" "$limit" "$@" >"$log" 2>&1 </dev/null &
    CHILD=$!
    wait "$CHILD"
    status=$?
    while ((status > 128)) && kill -0 "$CHILD" 2>/dev/null; do # (wait was cut short by a signal)
        wait "$CHILD"
        status=$?
    done
    CHILD=""
    local secs=$((SECONDS - start)) result=passed
    if ((INTERRUPTED)); then
        result="interrupted"
    elif ((status == 124 || (status == 137 && secs >= limit))); then
        # (124: timeout's TERM ended it; 137 at the limit: its KILL did. A 137 before the
        # limit is some other SIGKILL, such as the kernel's out-of-memory killer.)
        result="timed out after ${limit} s"
    elif ((status != 0)); then
        result="failed"
    elif [[ -n ${CHECK:-} ]]; then
        local why
        why=$("$CHECK" "$log")
        [[ -z $why ]] || result="failed: $why"
    fi
    record "$name" "$result" "$status" "$secs" "$limit" "$cmd" "${log#"$RES"/}" "$what"
    write_readme
    if [[ $result == passed ]]; then
        say "$name: passed in ${secs} s"
        return 0
    fi
    local why=""
    [[ $result == *": "* ]] && why=": ${result#*: }"
    say "$name: ${result%%: *} (exit $status$why) in ${secs} s; the end of its log, $(shown "$log"):"
    tail -n 15 "$log" | sed 's/^/    /'
    return 1
}

on_signal() {
    INTERRUPTED=1
    [[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null
}

# keep_run RUN DEST: a finished run folder's small files (summary, metrics, config), without
# its checkpoints or plots, into the results. The summary's plots give way to one line on how
# to redraw them (benchmarks/results/README.md; tests/unit/test_results_size.py refuses plots
# in a run folder).
keep_run() {
    [[ -d $1 ]] || return 0
    mkdir -p "$2"
    find "$1" -maxdepth 1 -type f ! -name 'checkpoint*.pt' ! -name '.edgc.lock' ! -name '*.png' -exec cp {} "$2"/ \;
    if [[ -f $2/summary.md ]] && grep -q '^!\[[^]]*\]([^)]*\.png)$' "$2/summary.md"; then
        sed -i '/^!\[[^]]*\]([^)]*\.png)$/d' "$2/summary.md"
        printf '%s\n' "Plots (loss, entropy, rank, bytes): not kept in the repository. \`edgc report RUN\` redraws them from this run's metrics.jsonl ([redrawing the plots](../../../../README.md#redrawing-the-plots))." >>"$2/summary.md"
    fi
}

# --- the parts ------------------------------------------------------------------------

# no_skipped_tests LOG: a CUDA test skipped on a machine with a GPU has checked nothing
# (pytest's -ra, in pyproject.toml, lists each skip as a SKIPPED line), unless it was
# skipped for want of the train extra (tests/distributed/test_cuda.py): then the tests that
# need torch alone still ran, and the warning at the start says what is missing.
no_skipped_tests() {
    local skipped
    skipped=$(grep '^SKIPPED' "$1" | grep -vc 'needs the train extra')
    ((skipped == 0)) || echo "$skipped SKIPPED line(s) in its log, on a machine with a GPU"
}

run_parts() {
    local train=("$PY" -m edgc train --device cuda --dtype "$DTYPE" --method edgc --steps 100
        --data-cache "$WORK/data" --no-progress)

    # What one compression round costs (benchmarks/round_cost.py): no hook, torch's
    # powerSGD_hook and edgc's in its two wires, one process each, against one read of the
    # gradient; first, as the figures a GPU alone can give.
    LOG_AS=round-cost/gpt2-345m.txt part round-cost-345m 90 "one compression round, gpt2-345m in float32: time, memory, ops" \
        "$PY" benchmarks/round_cost.py --device cuda --preset gpt2-345m --dtype float32 --batch 8 --block 512 \
        --json "$RES/round-cost/gpt2-345m.json"
    LOG_AS=round-cost/gpt2-2.5b.txt part round-cost-2.5b 150 "one compression round, gpt2-2.5b in bf16: time, memory, ops" \
        "$PY" benchmarks/round_cost.py --device cuda --preset gpt2-2.5b --dtype bf16 --batch 4 --block 512 \
        --json "$RES/round-cost/gpt2-2.5b.json"

    # Every test marked `cuda` (pyproject.toml), found by its marker so that a new one is
    # run too; only the files that use it are collected, so that a missing optional extra
    # (lightning, transformers) cannot fail the collection. --runslow: tests/distributed is
    # the slow tier otherwise (tests/conftest.py).
    local files
    mapfile -t files < <(cd "$ROOT" && grep -rlE --include='test_*.py' 'pytest\.mark\.cuda\b' tests | sort)
    CHECK=no_skipped_tests part cuda-tests 200 "every test marked \`cuda\` (pytest -m cuda)" \
        "$PY" -m pytest -p no:cacheprovider -q --runslow -m cuda --junitxml="$RES/cuda-tests.xml" "${files[@]}"

    # DDP with the EDGC hook over NCCL, $DTYPE. NCCL refuses two ranks on one GPU, so with one
    # GPU this is one worker (the hook's CUDA path, its collectives skipped) and the next part
    # shares the GPU between two workers over gloo, which carries CUDA tensors; with two GPUs
    # or more, two workers over NCCL. (`edgc train` picks the backend: process_group_backend.)
    local nccl_procs=$((GPUS >= 2 ? 2 : 1)) dtype=$DTYPE workers="1 worker"
    [[ $DTYPE == bf16 ]] || dtype="$DTYPE (this GPU has no bf16)"
    ((nccl_procs == 1)) || workers="$nccl_procs workers"
    part ddp-nccl 90 "$dtype DDP with the EDGC hook, $workers over NCCL" \
        "${train[@]}" --nproc "$nccl_procs" --out "$WORK/ddp-nccl"
    keep_run "$WORK/ddp-nccl" "$RES/runs/ddp-nccl"
    if ((GPUS == 1)); then
        part ddp-shared-gpu 75 "$dtype DDP with the EDGC hook, 2 workers sharing the GPU over gloo" \
            "${train[@]}" --nproc 2 --out "$WORK/ddp-shared-gpu"
        keep_run "$WORK/ddp-shared-gpu" "$RES/runs/ddp-shared-gpu"
    elif selected ddp-shared-gpu && [[ -n $ONLY ]]; then
        say "ddp-shared-gpu: not needed with $GPUS GPUs: ddp-nccl runs 2 workers, a GPU each"
    fi

    # HSDP (FSDP2 shards, edgc on the replicas' all-reduce) over NCCL: a 1 x 1 mesh on one GPU
    # (FSDP2, the hook's streams and the eager core on CUDA), 2 replicas with 2 or 3 GPUs,
    # 2 replicas x 2 shards with 4 or more.
    local layout=(1 1)
    ((GPUS >= 2)) && layout=(2 1)
    ((GPUS >= 4)) && layout=(2 2)
    part hsdp-nccl 60 "$dtype HSDP with EDGC, ${layout[0]} replicas x ${layout[1]} shards over NCCL" \
        "${train[@]}" --dp-replicate "${layout[0]}" --dp-shard "${layout[1]}" --out "$WORK/hsdp-nccl"
    keep_run "$WORK/hsdp-nccl" "$RES/runs/hsdp-nccl"

    # torchtitan's own trainer with edgc over NCCL (docs/torchtitan.md): llama3's debug model
    # on the built-in corpus, 2 replicas (x shards with 4 GPUs or more), 20 steps. NCCL
    # refuses two ranks on one GPU, and edgc needs 2 replicas: it needs 2 GPUs, and the
    # torchtitan extra (carried as wheels to a lent machine, docs/developing.md).
    if ((GPUS >= 2)); then
        if ((DRY_RUN)) || "$PY" -c "import torchtitan" 2>/dev/null; then
            part torchtitan 120 "torchtitan's trainer with edgc, llama3_debugmodel, 2 replicas over NCCL" \
                "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" -m torchtitan.train \
                --module edgc.integrations.torchtitan --config llama3_debugmodel \
                --parallelism.data-parallel-replicate-degree 2 --training.steps 20 --dump-folder "$WORK/torchtitan"
        elif selected torchtitan; then
            say "torchtitan: not run: torchtitan is not installed (pip install 'edgc[torchtitan]', or carry its wheels)"
        fi
    elif selected torchtitan && [[ -n $ONLY ]]; then
        say "torchtitan: not run: edgc needs 2 replicas, so 2 GPUs ($GPUS here)"
    fi

    # Our hook against torch's powerSGD_hook: the command of the CPU page
    # (benchmarks/results/cpu-20261122/hook-vs-torch.md), on the GPU.
    LOG_AS=hook-vs-torch.txt part hook-vs-torch 90 "our hook against torch's powerSGD_hook, timed" \
        "$PY" benchmarks/hook_vs_torch.py --device cuda --preset tiny --rank 4 --steps 30

    # The projections of benchmarks/results/h100-20261122/simulate/, with the compression
    # timed on this GPU; the saved profiles reproduce them anywhere (--profile).
    local cluster
    for cluster in 2.5b 12.1b; do
        LOG_AS=simulate/sim-paper-$cluster.txt part "simulate-$cluster" 45 \
            "\`edgc simulate\`, paper-$cluster, costs timed here" \
            "$PY" -m edgc simulate --cluster "paper-$cluster" --device cuda --repeats 5 \
            --save-profile "$RES/simulate/profile-paper-$cluster.json"
    done
}

# --- the README -----------------------------------------------------------------------

write_readme() {
    local i n=${#R_NAME[@]} passed=0 status
    for ((i = 0; i < n; i++)); do [[ ${R_STATUS[i]} == passed ]] && passed=$((passed + 1)); done
    {
        printf '# GPU check, %s: %s\n\n' "${DAY:0:4}-${DAY:4:2}-${DAY:6:2}" "${PROBE[gpu_name]}"
        printf '[Benchmark index](../../../../BENCHMARKS.md). `bash scripts/gpu-check.sh%s` on a machine with %s x %s (%s GiB), ' \
            "$ARGS_SHOWN" "$GPUS" "${PROBE[gpu_name]}" "${PROBE[gpu_memory_gib]}"
        printf '%s CPU cores, Python %s, torch %s (CUDA %s, cuDNN %s, NCCL %s), edgc %s at %s, ' \
            "${PROBE[cpus]}" "${PROBE[python]}" "${PROBE[torch]}" "${PROBE[cuda_build]}" "${PROBE[cudnn]}" \
            "${PROBE[nccl]}" "${PROBE[edgc]:-?}" "$COMMIT"
        printf 'started %s. `python` below is `%s` (%s).\n\n' "$STARTED" "$PY" "${PROBE[executable]}"
        if ((n == 0)); then
            printf 'No part has finished yet.\n\n'
        else
            printf '**%d of %d parts passed.** Each part ran under `timeout`, its limit scaled by `--time-scale`;\n' \
                "$passed" "$n"
            printf 'its output is in its log.\n\n'
        fi
        printf '| part | what it checks | result | exit | time (s) | limit (s) | log |\n'
        printf '|---|---|---|---:|---:|---:|---|\n'
        for ((i = 0; i < n; i++)); do
            status=${R_STATUS[i]}
            [[ $status == passed ]] || status="**$status**"
            printf '| `%s` | %s | %s | %s | %s | %s | %s |\n' "${R_NAME[i]}" "${R_WHAT[i]}" "$status" \
                "${R_EXIT[i]:-–}" "${R_SECS[i]:-–}" "${R_LIMIT[i]}" "${R_LOG[i]:+[${R_LOG[i]}](${R_LOG[i]})}"
        done
        printf '\nThe run folders of the training parts, without their checkpoints, are in `runs/`.\n'
        printf '\n## Commands\n\nFrom the repository root, with `PYTHONPATH=src`:\n\n```bash\n'
        for ((i = 0; i < n; i++)); do
            printf '%s%s\n' "$(shown "${R_CMD[i]}")" "${R_LOG[i]:+   # > ${R_LOG[i]}}"
        done
        printf '```\n\n## Device\n\n```\n%s\n```\n' "$DEVICE_TEXT"
    } >"$RES/README.md.tmp" && mv "$RES/README.md.tmp" "$RES/README.md"
}

# --- main -----------------------------------------------------------------------------

main() {
    ONLY="" DRY_RUN=0 SCALE=${GPU_CHECK_TIME_SCALE:-1}
    ARGS_SHOWN=""
    ((${#})) && ARGS_SHOWN=" $*"
    while (($#)); do
        case $1 in
        --only) [[ $# -ge 2 ]] || die "--only needs a list of parts"; ONLY=$2; shift ;;
        --only=*) ONLY=${1#*=} ;;
        --time-scale) [[ $# -ge 2 ]] || die "--time-scale needs a number"; SCALE=$2; shift ;;
        --time-scale=*) SCALE=${1#*=} ;;
        --dry-run) DRY_RUN=1 ;;
        --list) printf '%s\n' $PARTS; exit 0 ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown option '$1' (--help lists them)" ;;
        esac
        shift
    done
    [[ $SCALE =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v s="$SCALE" 'BEGIN { exit !(s > 0) }' ||
        die "--time-scale must be a positive number, got '$SCALE'"
    local p
    for p in ${ONLY//,/ }; do
        [[ " $PARTS " == *" $p "* ]] || die "no part '$p' (the parts: ${PARTS// /, })"
    done
    BUDGET=$(scaled "$BUDGET_S")
    # where the results folder goes: under $OUT (made absolute before the cd below; made only
    # once there is something to write), else in this checkout
    OUT_ROOT=$ROOT
    if [[ -n ${OUT:-} ]]; then
        OUT_ROOT=$OUT
        [[ $OUT == /* ]] || OUT_ROOT="$PWD/$OUT"
    fi
    cd "$ROOT" || die "cannot enter $ROOT"
    export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

    PY=$(find_python)
    [[ -n $PY ]] || die "no python: neither .venv/bin/python nor python3 is here (GPU_CHECK_PYTHON names one)"
    DAY=$(date +%Y%m%d)

    if ((DRY_RUN)); then # the plan only: nothing is probed, run or written
        GPUS=${GPU_CHECK_GPUS:-1} DTYPE=bf16 WORK=/tmp/gpu-check RES="benchmarks/results/gpu-$DAY/gpu-check"
        RES_SHOWN=$RES
        run_parts
        exit 0
    fi

    # What this machine has, before anything is written: without CUDA there is nothing to
    # check, and an empty results folder would only mislead.
    local probe
    probe=$(probe_python "$PY")
    read_probe "$probe"
    [[ -n ${PROBE[python]:-} ]] || die "no usable python: '$PY' did not run (${probe//$'\n'/ })"
    say "python: $PY (Python ${PROBE[python]}, ${PROBE[executable]})"
    [[ -z ${PROBE[error]:-} ]] || die "no CUDA: ${PROBE[error]} (python: $PY); nothing was run or written"
    local key
    for key in executable cpus torch cuda_build cuda_available gpus gpu_name gpu_memory_gib bf16 cudnn nccl edgc; do
        PROBE[$key]=${PROBE[$key]:-?}
    done
    if [[ ${PROBE[cuda_available]} != 1 ]]; then
        if [[ ${PROBE[cuda_build]} == None ]]; then
            die "no CUDA: torch ${PROBE[torch]} is a CPU-only build (python: $PY); nothing was run or written"
        fi
        die "no CUDA: torch ${PROBE[torch]} (CUDA ${PROBE[cuda_build]}) sees no GPU" \
            "(torch.cuda.is_available() is False); nothing was run or written"
    fi
    GPUS=${PROBE[gpus]}
    DTYPE=bf16
    [[ ${PROBE[bf16]} == 1 ]] || DTYPE=fp16
    say "torch ${PROBE[torch]}, CUDA ${PROBE[cuda_build]}, NCCL ${PROBE[nccl]}: $GPUS x ${PROBE[gpu_name]}"
    [[ -z ${PROBE[edgc_error]:-} ]] || say "warning: edgc does not import: ${PROBE[edgc_error]}"
    [[ -z ${PROBE[missing]:-} ]] ||
        say "warning: missing ${PROBE[missing]} (edgc and its train extra need them): the edgc commands will fail"
    [[ ${PROBE[pytest]:-0} == 1 ]] || say "warning: pytest is not installed: cuda-tests will fail"

    # The results folder: <gpu>-<date>/gpu-check, beside the other pages of that day, or
    # gpu-check-HHMMSS when a check already ran that day (here or in the checkout that was
    # copied here: its results are to be copied back beside them).
    local folder
    folder="$(gpu_short_name "${PROBE[gpu_name]:-}")-$DAY"
    RES_SHOWN="benchmarks/results/$folder/gpu-check"
    if [[ -e $OUT_ROOT/$RES_SHOWN || -e $ROOT/$RES_SHOWN ]]; then
        RES_SHOWN+="-$(date +%H%M%S)"
    fi
    RES="$OUT_ROOT/$RES_SHOWN"
    mkdir -p "$RES/logs" || die "cannot make $RES"
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/edgc-gpu-check.XXXXXX") || die "cannot make a scratch folder"
    trap 'rm -rf "$WORK"' EXIT
    trap on_signal INT TERM
    say "results: $RES"

    STARTED="$(date -u '+%Y-%m-%d %H:%M:%S') UTC"
    COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) || COMMIT="an unknown commit (no .git in this copy)"
    [[ -n $(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null) ]] && COMMIT+=" with uncommitted changes"
    DEVICE_TEXT="$(printf '%s\n' "$probe" | sort)
$(if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not found"; fi)"
    printf '%s\n' "$DEVICE_TEXT" >"$RES/device.txt"
    write_readme

    run_parts

    write_readme
    local n=${#R_NAME[@]} i failed=()
    for ((i = 0; i < n; i++)); do
        [[ ${R_STATUS[i]} == passed ]] || failed+=("${R_NAME[i]} (${R_STATUS[i]})")
    done
    if ((n == 0)); then
        say "no part was selected"
        exit 1
    elif ((${#failed[@]})); then
        say "$((n - ${#failed[@]})) of $n parts passed; not passed: $(IFS=';'; echo "${failed[*]}" | sed 's/;/, /g')"
        say "results: $RES"
        ((INTERRUPTED)) && exit 130
        exit 1
    fi
    say "all $n parts passed in ${SECONDS} s; results: $RES"
}

# (sourced, as the tests do for gpu_short_name, it only defines the functions)
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
