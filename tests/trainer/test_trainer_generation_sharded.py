"""Each epoch's generation runs sharded (generation.generate_share): two gloo ranks, each on
its own FSDP2 shard of the tiny Gemma, answer their shares of the held-out prompts (one rank's
share padded to the other's count); the answers are those of a single process's greedy
`generate` on the whole model, prompt by prompt; both ranks ran as many forwards, though one's answers ended at their first token; and no rank
ever held the model's full parameters: the bytes each held materialised, counted around every
module's forward, stay under the full model's, its decoder blocks' never more than their shards
plus one gathered block, and every block's parameters are shards again after (the root's group,
embeddings and norms, stays gathered after the root's forward, as FSDP2 keeps it for training)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tpufinetune_trainer import generation
from tpufinetune_trainer.data import pad_id_of, prepare
from tpufinetune_trainer.model import load_causal_lm, load_tokenizer
from trainer_helpers import run_rank_processes

WORKER = Path(__file__).with_name("trainer_generation_worker.py")
MAX_NEW_TOKENS = 12


def single_process_answers(model_dir: Path, prompts: list[list[int]], pad_id: int, eos_ids: list[int]) -> list:
    model = load_causal_lm(str(model_dir), torch.float32, "sdpa").eval()
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=pad_id, eos_token_id=eos_ids)
            tokens = out[0, len(prompt):].tolist()
            answers.append(tokens[:next((k for k, t in enumerate(tokens) if t in eos_ids), len(tokens))])
    return answers


def test_two_ranks_answer_as_one_process_does_without_holding_the_whole_model(trainer_assets, tmp_path):
    tokenizer = load_tokenizer(str(trainer_assets.model))
    prepared = prepare(str(trainer_assets.data), "train[:160]", tokenizer, 256, 0.1, 42)
    items = generation.held_out(prepared.eval, 5)  # odd: rank 1's share is padded to rank 0's count
    prompts = [item.prompt for item in items]
    assert len(prompts) == 5 and len({len(p) for p in prompts}) > 1  # left padding within a rank's batch
    pad_id = pad_id_of(tokenizer)
    # Rank 1's answers (prompts 1 and 3) end at their first token: it is done long before
    # rank 0, and must go on stepping with it (each of rank 0's forwards gathers from it).
    plain = single_process_answers(trainer_assets.model, prompts, pad_id, [tokenizer.eos_token_id])
    eos_ids = [tokenizer.eos_token_id, plain[1][0], plain[3][0]]
    # Two prompts a batch: rank 0 answers [0, 2] then [4], rank 1 [1, 3] then its filler.
    spec = {"prompts": prompts, "max_new_tokens": MAX_NEW_TOKENS, "pad_id": pad_id, "eos_ids": eos_ids,
            "batch_size": 2}
    (tmp_path / "prompts.json").write_text(json.dumps(spec))
    run_rank_processes(WORKER, 2, lambda rank, port: [str(trainer_assets.model), str(tmp_path / "prompts.json"),
                                                      str(tmp_path / "out"), str(port), str(rank), "2"])
    ranks = [json.loads((tmp_path / f"out.{rank}.json").read_text()) for rank in range(2)]
    sharded = {int(k): v for rank in ranks for k, v in rank["answers"].items()}
    assert sorted(sharded) == [0, 1, 2, 3, 4] and sorted(map(int, ranks[1]["answers"])) == [1, 3]
    expected = single_process_answers(trainer_assets.model, prompts, pad_id, eos_ids)
    assert [sharded[i] for i in range(5)] == expected
    assert expected[1] == expected[3] == [] and max(len(expected[i]) for i in (0, 2, 4)) > 1
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > 1
    for rank in ranks:
        assert rank["sharded_after"], rank
        assert rank["peak_bytes"] < rank["full_bytes"], rank
        # The blocks: their halves, plus at most one block gathered at a time.
        assert rank["peak_block_bytes"] <= (rank["blocks_full_bytes"] + rank["block_bytes"]) // 2, rank
