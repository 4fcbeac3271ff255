"""The accuracy report's teacher-forced count (benchmarks/studies/quantization_accuracy.py)."""

import torch

from benchmarks.studies.quantization_accuracy import teacher_forced_agreement


def test_teacher_forced_counts_each_new_position_and_the_margin_where_they_differ():
    prompt_len, vocab = 3, 5
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(2, 7, vocab, generator=generator)  # 2 sequences, 3 prompt + 4 new tokens
    quantized = reference.clone()
    # Position 4 of sequence 1 predicts a new token: the quantized model's top token moves there only.
    top2 = reference[1, 4].topk(2)
    quantized[1, 4, top2.indices[1]] = top2.values[0] + 1.0
    # The prompt's positions before prompt_len - 1 and the last position predict no new token: not counted.
    quantized[0, 0] = -reference[0, 0]
    quantized[0, 6] = -reference[0, 6]
    result = teacher_forced_agreement(reference, quantized, prompt_len)
    assert result["teacher_forced_tokens_equal"] == "7/8"
    margin = (top2.values[0] - top2.values[1]).item()
    assert result["teacher_forced_reference_margins_where_different"] == [round(margin, 6)]
    new_positions = reference[:, prompt_len - 1 : -1].topk(2, dim=-1).values
    median = (new_positions[..., 0] - new_positions[..., 1]).median().item()
    assert result["reference_median_margin"] == round(median, 6)
