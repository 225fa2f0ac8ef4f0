"""An RL rollout loop that time-shares the device with a trainer.

generate -> sleep(level=1, mode="keep", clear_connector_cache=False) -> a training
step -> wake_up -> the paused samples resume, loading their KV from the host tier
instead of re-prefilling it. Run:

    python examples/rl_rollout.py                   # the embedded SmolLM2 on CPU
    python examples/rl_rollout.py --change-weights  # the trainer changes the weights
"""

from __future__ import annotations

import argparse
import time

import torch

from siesta import LLM, SamplingParams

TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}  # fmt: skip


def train_step(llm: LLM, change_weights: bool) -> list[tuple[str, torch.Tensor]] | None:
    """Stands in for the trainer: returns new weights (HF names, as in a state_dict) or None."""
    time.sleep(0.1)
    if not change_weights:
        return None
    new = []
    for name, tensor in llm.engine.source.iter_weights(llm.engine.runner.dtype):
        if name.endswith("mlp.down_proj.weight"):
            tensor = tensor * 1.01  # a small step
        new.append((name, tensor))
    return new


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--change-weights", action="store_true")
    args = ap.parse_args()

    llm = LLM(args.model, kv_transfer_config=TIER)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)
    question = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = [llm.add_request({"prompt_token_ids": llm.get_tokenizer().apply_chat_template(
        question, add_generation_prompt=True, tokenize=True, return_dict=False)}, params.replace(seed=i))
        for i in range(args.samples)]  # fmt: skip

    for _ in range(args.max_tokens // 2):  # rollouts are half done when the trainer needs the device
        llm.step()
    llm.sleep(level=1, mode="keep", clear_connector_cache=False)
    print(f"asleep: {llm.is_sleeping()}; the trainer takes the device")

    weights = train_step(llm, args.change_weights)
    llm.wake_up(tags=["weights"])
    if weights is not None:
        print(f"new weight version {llm.update_weights(weights)}")
        llm.finish_weight_update()
    llm.wake_up(tags=["kv_cache"])

    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    for rid in ids:
        out = done[rid]
        print(f"--- sample {rid} (weights {out.weight_version}) ---\n{out.outputs[0].text}")
    m = llm.get_metrics()
    loaded_mb = m.get('siesta_kv_offload_load_bytes_total{tier="host"}', 0.0) / 1e6
    print(f"\nresumed from the tier: {m['siesta_external_prefix_cache_hits_total']:.0f} tokens, {loaded_mb:.1f} MB")


if __name__ == "__main__":
    main()
