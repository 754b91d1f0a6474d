#!/usr/bin/env bash
# One command for a machine with one CUDA GPU (about 5 minutes); CI never runs it.
#   bash benchmarks/gpu_check.sh            # results in benchmarks/results/gpu_*
# 1. backends agree in bf16, which SDPA kernel ran, flex compiled (gpu_check.py)
# 2. ViT-B/16 and Swin-T train + infer img/s and MFU in bf16 autocast, beside timm eager and compiled
# 3. decoding tokens/s with and without the KV cache
# 4. the tests marked `gpu` (no host sync in a training step)
# 5. the FSDP2 recipe (ViT-L/16, bf16-mixed, activation checkpointing) trains 4 steps on every GPU present
# 6. an MAE step beside a classifier step of ViT-B/16 and ViT-L/16 (img/s, memory), and MAE pre-training 4 steps
# 7. a DeiT-S step with and without its RegNetY-16GF teacher's forward
# 8. fine-tuning memory of ViT-B/16 and ViT-L/16 at batch 32: whole model, LoRA, LoRA + checkpointing, frozen
# 9. the whole training run, `vitkit train fit` beside timm's train.py (if ../shared/peers/timm/train.py is there)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=benchmarks/results
$PY benchmarks/gpu_check.py | tee $OUT/gpu_check.txt
for model in vit_base_patch16_224 swin_tiny_patch4_window7_224; do
  short=${model%%_patch*}
  $PY benchmarks/throughput.py --models $model --peers timm --mode both --batch-sizes 128 --precision amp_bf16 \
      --device cuda --rounds 2 --iters 10 --warmup 3 --out $OUT/gpu_${short}_eager.csv
  $PY benchmarks/throughput.py --models $model --peers timm --mode both --batch-sizes 128 --precision amp_bf16 \
      --device cuda --rounds 2 --iters 10 --warmup 3 --compile --out $OUT/gpu_${short}_compiled.csv
done
$PY benchmarks/decode.py --model transformer_base --batch-size 32 --new-tokens 128 --device cuda \
    --out $OUT/gpu_transformer_base_decode.csv
$PY -m pytest -q -m gpu tests | tee $OUT/gpu_tests.txt
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
$PY train.py fit --config vit_large_in1k_fsdp --trainer.devices "$NGPU" --trainer.max_steps 4 \
    --trainer.limit_val_batches 1 --trainer.logger false --data vitkit.lit.DigitsDataModule --data.batch_size 32 \
    --data.num_workers 2 --trainer.default_root_dir $OUT/gpu_fsdp2 2>&1 | tail -5 | tee $OUT/gpu_fsdp2.txt
$PY benchmarks/mae_speed.py --models vit_base_patch16_224,vit_large_patch16_224 --batch-size 64 --device cuda \
    --out $OUT/gpu_mae_speed.md
$PY train.py fit --config mae_vit_base_in1k --trainer.devices 1 --trainer.num_nodes 1 --trainer.max_steps 4 \
    --trainer.limit_val_batches 1 --trainer.logger false --data vitkit.lit.DigitsDataModule --data.img_size 224 \
    --data.batch_size 32 --trainer.default_root_dir $OUT/gpu_mae 2>&1 | tail -5 | tee $OUT/gpu_mae.txt
$PY benchmarks/distill_cost.py --batch-size 64 --device cuda --out $OUT/gpu_distill_cost.md
$PY benchmarks/finetune_memory.py --batch-size 32 --device cuda --warmup 2 --steps 5 --out $OUT/gpu_finetune_memory.md
TIMM_TRAIN=${TIMM_TRAIN:-../shared/peers/timm/train.py}
if [ -f "$TIMM_TRAIN" ]; then
  $PY benchmarks/train_run.py --timm-train "$TIMM_TRAIN" --device cuda --workers 8 --batch 128 --precision bf16 --sizes 64 224 \
      --augment off on --out $OUT/gpu_train_run.json
fi
cat $OUT/gpu_mae_speed.md $OUT/gpu_distill_cost.md $OUT/gpu_finetune_memory.md $OUT/gpu_*_eager.md $OUT/gpu_*_compiled.md $OUT/gpu_transformer_base_decode.md
