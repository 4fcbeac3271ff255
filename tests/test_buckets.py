"""The bucket policy (tpu_kernels/runtime/buckets.py): few sizes, each a bound that holds its size."""

import pytest

from tpu_kernels.runtime.buckets import key_bucket, key_buckets, token_bucket, token_buckets

SIZES = list(range(1, 5000)) + [8191, 8192, 8193, 100_000, 131_072, 131_073]


@pytest.mark.parametrize("bucket_of", [token_bucket, key_bucket])
def test_a_bucket_holds_its_size_and_grows_with_it(bucket_of):
    buckets = [bucket_of(n) for n in SIZES]
    assert all(bucket >= n for bucket, n in zip(buckets, SIZES))
    assert buckets == sorted(buckets)
    # A bucket is its own bucket: padding twice changes nothing.
    assert all(bucket_of(bucket) == bucket for bucket in set(buckets))


def test_token_buckets_follow_the_serving_ladder_and_are_exact_at_their_edges():
    assert token_buckets(4096) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4096]
    for bucket in token_buckets(4096):
        assert token_bucket(bucket) == bucket
        assert token_bucket(bucket + 1) > bucket
    assert token_bucket(1) == 16 and token_bucket(17) == 32 and token_bucket(513) == 1024


def test_key_buckets_are_lane_multiples_growing_by_half_octaves():
    ladder = key_buckets(131_072)
    assert ladder[:8] == [128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert all(bucket % 128 == 0 for bucket in ladder)
    assert len(ladder) == 20, "a 128K context compiles attention for 20 key lengths at most"
    for bucket in ladder:
        assert key_bucket(bucket) == bucket and key_bucket(bucket + 1) > bucket
    # Padding adds at most 127 keys up to 512 and at most half the real keys beyond.
    assert all(key_bucket(n) - n < 128 for n in range(1, 513))
    assert all(key_bucket(n) <= 1.5 * n for n in range(513, 20_000))


def test_generating_128_tokens_from_any_prompt_sees_at_most_two_key_buckets():
    # Every bucket is at least 128 keys wide, so 129 consecutive key lengths touch at most two.
    ladder = key_buckets(131_072)
    assert min(high - low for low, high in zip([0, *ladder], ladder)) == 128
    for prompt in [*range(1, 1100), 3071, 3072, 3073, 100_000]:
        assert len({key_bucket(n) for n in range(prompt, prompt + 129)}) <= 2


def test_the_lists_end_with_the_bucket_holding_the_max():
    assert token_buckets(1) == [16] and key_buckets(1) == [128]
    assert token_buckets(17)[-1] == 32 and key_buckets(129)[-1] == 256
    assert key_buckets(2048)[-1] == 2048 and key_buckets(2049)[-1] == 3072


@pytest.mark.parametrize("function", [token_bucket, key_bucket, token_buckets, key_buckets])
def test_bad_sizes_are_refused(function):
    with pytest.raises(ValueError, match="at least 1"):
        function(0)
    with pytest.raises(TypeError, match="must be an int"):
        function(2.0)
    with pytest.raises(TypeError, match="must be an int"):
        function(True)
