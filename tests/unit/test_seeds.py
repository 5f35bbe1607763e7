"""The one seeding rule (sampling/seeds.py) gives the seeds the runner's and the drafters' own
formulas gave, so seeded outputs stay what they were."""

from k3serve.sampling.seeds import request_seed


def test_the_sampler_and_the_drafters_seeds_are_the_former_formulas():
    for seed, arrival, engine in ((None, 7, 0), (None, 7, 3), (12345, 7, 3), (0, 0, 9)):
        sampler = seed if seed is not None else engine * 1_000_003 + arrival  # runner/model_runner.py, before
        assert request_seed(seed, arrival, engine) == sampler
        for salt in (17, 29):  # DSpark's and the draft model's
            drafter = (seed if seed is not None else arrival) * 7919 + salt  # spec_decode/drafting.py, before
            assert request_seed(seed, arrival, salt=salt) == drafter
    assert request_seed(None, 1, 0) != request_seed(None, 2, 0) != request_seed(None, 2, 1)
