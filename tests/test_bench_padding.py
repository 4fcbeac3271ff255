"""The padding study (benchmarks/studies/padding.py): rows and bytes per bucket, from the bucket policy."""

import json

from benchmarks.studies import padding


def test_padding_costs_follow_the_buckets_and_the_row_sizes(tmp_path):
    out = tmp_path / "padding.json"
    assert padding.main(["--out", str(out), "--max-tokens", "600", "--max-keys", "700"]) == 0
    results = json.loads(out.read_text())
    assert results["token_buckets"] == [16, 32, 64, 128, 256, 512, 1024]
    assert results["key_buckets"] == [128, 256, 384, 512, 768]
    qwen3 = results["models"]["qwen3-30b-a3b"]["entry_points"]
    norm_32 = qwen3["rms_norm"][1]  # 17 rows padded to 32
    assert norm_32["holds"] == [17, 32] and norm_32["padded_rows"] == {"worst": 15, "mean": 7.5}
    assert norm_32["kernel_bytes"] == 15 * 2 * 2048 * 2
    assert norm_32["pad_copy_bytes"] == (17 + 32) * 2048 * 2
    assert norm_32["real_bytes"] == 17 * 2 * 2048 * 2
    per_head_32 = qwen3["rms_norm_per_head"][1]  # 17 tokens padded to 32, each with 32 q and 4 k heads
    assert per_head_32["padded_rows"]["worst"] == 15 and per_head_32["kernel_bytes"] == 15 * 2 * (32 + 4) * 128 * 2
    assert "rms_norm_per_head" not in results["models"]["gpt-oss-20b"]["entry_points"]
    keys_768 = qwen3["attention_keys"][4]  # 513 keys padded to 768: K and V copied whole, no padded key read
    assert keys_768["kernel_bytes"] == 0 and keys_768["pad_copy_bytes"] == (513 + 768) * 2 * 4 * 128 * 2
    v6e = keys_768["pad_copy_seconds"]["v6e"]
    assert keys_768["pad_copy_seconds"]["v5e"] > v6e > 0
    assert qwen3["attention_queries"][1]["query_flops"] == 4 * 15 * 17 * 32 * 128
