#!/usr/bin/env bash
# The GPU checks on a lent GPU, in one device call (10 minutes at most): what to run is named by
# the arguments, in order; each check has its own time limit, so one that hangs leaves time for
# the next.
#   graphs   the CUDA tests: padded micro-batches replayed from a CUDA graph equal eager steps
#            (tests/workers/test_graphed.py) and full-tailed noise on the device
#   step     the step_overhead table on CUDA: resnet18 and the transformer at B = 64, 256,
#            1024; non-private and ours, each eager and replayed from a CUDA graph, and Opacus'
#            ghost clipping
#   sharing  the shared-GPU tuning job (bench/trial_sharing.py: 4 trials of resnet18 on digits,
#            one by one and 4 at once)
#   profile  bench/device/profile_step.py on resnet18 at B = 64 and 256 (about a minute)
# Logs and JSON land in $OUT; docs/gpu/ keeps the last run's.
#
#     bash bench/device/pack.sh        # here, once: .gpu/site.tar.xz, the packages it lacks
#     device run, carry [".gpu"]: bash bench/device/run.sh graphs step sharing
set -u
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || set -- step
started=$(date +%s)
elapsed() { echo "$(( $(date +%s) - started )) s"; }
mkdir -p /tmp/site /tmp/bin "${OUT:=/tmp/out}"
[ -d /tmp/site/ray ] || tar xJf .gpu/site.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/bin:$PATH
# the two commands the benches start (no console scripts: the wheels were unpacked, not installed)
printf '#!/bin/sh\nexec python3 -c "import sys; from ray.scripts.scripts import main; sys.argv[0]=\\"ray\\"; sys.exit(main())" "$@"\n' > /tmp/bin/ray
printf '#!/bin/sh\nexec python3 -c "import sys; from service.cli import app; sys.argv[0]=\\"dptune\\"; app()" "$@"\n' > /tmp/bin/dptune
chmod +x /tmp/bin/ray /tmp/bin/dptune
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt"
import sys, torch, ray, opacus
from workers.dp.randomness import SecureStream
print(sys.version.split()[0], "torch", torch.__version__, "cudnn", torch.backends.cudnn.version(),
      torch.cuda.get_device_name(0), "ray", ray.__version__, "opacus", opacus.__version__)
x = SecureStream().normal(10_000_000, device="cuda")
print(f"secure noise on the GPU: mean {x.mean().item():.4f}, std {x.std().item():.4f}")
from workers.dp.normal import radii  # invariant 15: the tails of 53-bit uniforms on the GPU
top = radii(torch.tensor([-2**63], device="cuda"), out=torch.empty(1, device="cuda")).item()
far = sum((SecureStream().normal(10**8, device="cuda").abs() > 5).sum().item() for _ in range(4))
print(f"largest radius {top:.4f} (8.5717); |z| > 5 in 4e8 draws: {far} (229 ± 15 expected)")
PY
left() { echo $(( 570 - ($(date +%s) - started) )); }
limit() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
for what in "$@"; do
  case $what in
    graphs)
      timeout "$(limit 90)" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
        tests/workers/test_graphed.py tests/workers/test_device_noise.py > "$OUT/graphs.log" 2>&1
      echo "graphs: rc $? at $(elapsed)" ;;
    step)
      for model in resnet18 transformer; do
        timeout "$(limit 130)" python3 bench/step_overhead.py --models $model \
          --batches 64 256 1024 --seconds 0.5 --timeout 45 \
          --methods nonprivate nonprivate_graph fast fast_graph opacus_ghost \
          --json "$OUT/step_$model.json" > "$OUT/step_$model.log" 2>&1
        echo "step_overhead $model: rc $? at $(elapsed)"
      done ;;
    sharing)
      timeout "$(limit 200)" python3 bench/trial_sharing.py --model resnet18 --dataset digits \
        --epochs 2 --trials 4 --share 4 > "$OUT/sharing.log" 2>&1
      echo "trial_sharing: rc $? at $(elapsed)" ;;
    profile)
      timeout "$(limit 200)" python3 bench/device/profile_step.py resnet18 64 256 \
        > "$OUT/profile.log" 2>&1
      echo "profile: rc $? at $(elapsed)" ;;
    *) echo "unknown check: $what (graphs, step, sharing or profile)"; exit 2 ;;
  esac
done
for log in "$OUT"/*.log; do echo "== $log"; grep -v '^\s*$' "$log" | tail -22; done
