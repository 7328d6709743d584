"""What makes the evaluation trustworthy (issue 44): exact binomial intervals, evaluation keys that are new at every
length and absent from the training data, the reference's teacher-forced scoring beside the strict one, and
position-matched perplexity per document. Fake models with logits written here make the expected numbers exact."""

import math
import random
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.evaluation.intervals import clopper_pearson, interval_text
from bam_llama.evaluation.passkey import PasskeyKeys, evaluate_passkey, keys_in_texts, random_passkey
from bam_llama.evaluation.perplexity import position_matched_perplexity


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


# ---------------------------------------------------------------------------------------------- intervals


# 95% Clopper-Pearson intervals, computed with SciPy (beta.ppf(0.025, k, n - k + 1), beta.ppf(0.975, k + 1, n - k)).
@pytest.mark.parametrize(
    ("successes", "trials", "low", "high"),
    [
        (0, 5, 0.0, 0.521824), (9, 20, 0.230578, 0.684722), (20, 20, 0.831567, 1.0), (50, 50, 0.928878, 1.0),
        (16, 20, 0.563386, 0.942666), (19, 20, 0.751267, 0.998735), (1, 1, 0.025, 1.0), (0, 1, 0.0, 0.975),
        (3, 7, 0.098988, 0.815948), (25, 50, 0.355273, 0.644727), (1, 50, 0.000506, 0.106470),
    ],
)
def test_clopper_pearson_matches_the_exact_binomial_interval(successes, trials, low, high):
    assert clopper_pearson(successes, trials) == pytest.approx((low, high), abs=2e-6)


def binomial_sum(trials: int, probability: float, first: int, last: int) -> Fraction:
    """P(first <= X <= last) for X ~ Binomial(trials, probability), exactly: the float is a / d, d a power of two,
    and the sum of C(n, k) a^k (d - a)^(n - k) over d^n is summed in integers (Horner's rule in a)."""
    if first > last:
        return Fraction(0)
    a, d = probability.as_integer_ratio()
    total, power = 0, 1
    for k in range(last, first - 1, -1):  # sum of C(n, k) a^(k - first) (d - a)^(last - k)
        total = total * a + math.comb(trials, k) * power
        power *= d - a
    return Fraction(total * a**first * (d - a) ** (trials - last), d**trials)


def at_most(successes: int, trials: int, probability: float) -> Fraction:
    """P(X <= successes), exactly, from the shorter of its two sums."""
    if successes < trials / 2:
        return binomial_sum(trials, probability, 0, successes)
    return 1 - binomial_sum(trials, probability, successes + 1, trials)


# Each end of a 95% interval pinned to 1e-9 by the exact binomial tails on either side of it (2.5% each): thousands
# of trials (1,000 of 2,000 sums a thousand terms, each far outside a double's range) and the edges 0 of n, n of n.
INTERVAL_EDGES = [(0, 1), (1, 1), (0, 2), (1, 2), (2, 2), (0, 2000), (1, 2000), (1000, 2000), (1999, 2000),
                  (2000, 2000), (999, 2000), (3, 5000)]


@pytest.mark.parametrize(("successes", "trials"), INTERVAL_EDGES)
def test_clopper_pearson_ends_hold_the_exact_binomial_tails(successes, trials):
    """The lower end p solves P(X >= k | p) = 2.5%, the upper P(X <= k | p) = 2.5%: each tail, computed here in
    exact arithmetic just below and just above the end, lies on either side of 2.5%. 0 successes give the lower
    end 0 and the upper 1 - 0.025^(1/n); n of n the upper end 1 and the lower 0.025^(1/n)."""
    low, high = clopper_pearson(successes, trials)
    tail, step = Fraction(1, 40), 1e-9
    if successes == 0:
        assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / trials), abs=1e-12)
    else:
        assert 1 - at_most(successes - 1, trials, low - step) < tail < 1 - at_most(successes - 1, trials, low + step)
    if successes == trials:
        assert high == 1.0 and low == pytest.approx(0.025 ** (1 / trials), abs=1e-12)
    else:
        assert at_most(successes, trials, high - step) > tail > at_most(successes, trials, high + step)


def test_interval_text_rounds_outwards_and_bad_counts_are_refused():
    assert interval_text(9, 20) == "23-69" and interval_text(0, 5) == "0-53" and interval_text(20, 20) == "83-100"
    for successes, trials in ((3, 2), (-1, 4), (0, 0)):
        with pytest.raises(ValueError):
            clopper_pearson(successes, trials)


# ---------------------------------------------------------------------------------------------- keys


def test_a_key_of_the_training_data_is_drawn_again_and_counted():
    first = PasskeyKeys(seed=0, num_digits=5, excluded=set()).draw()
    keys = PasskeyKeys(seed=0, num_digits=5, excluded={first})
    drawn = [keys.draw() for _ in range(30)]
    assert first not in drawn and keys.redrawn == 1
    assert keys.count_in_training(drawn) == 0 and keys.count_in_training([first, *drawn]) == 1
    assert PasskeyKeys(seed=0, num_digits=5).count_in_training(drawn) is None  # no training data given: unknown


def test_evaluation_keys_are_not_the_training_stream_of_the_same_seed():
    """Training sets draw `random_passkey(random.Random(seed), 5)`: the evaluation's stream is another."""
    training = random.Random(0)
    training_keys = [random_passkey(training, 5) for _ in range(20)]
    keys = PasskeyKeys(seed=0, num_digits=5)
    assert len(set(training_keys) & {keys.draw() for _ in range(20)}) <= 1


def test_keys_in_texts_finds_every_digit_string_of_the_key_length():
    found = keys_in_texts(["the key 1234567 and 99999.", "x 1234 y 00042"], 5)
    assert found == {"12345", "23456", "34567", "99999", "00042"}


def test_evaluate_passkey_records_the_keys_found_in_training(tokenizer, fake_model):
    first_keys = evaluate_passkey(fake_model, tokenizer, [300], num_depths=3, progress=False).passkeys[0]
    keys = PasskeyKeys(seed=0, num_digits=5, excluded=set(first_keys[:2]))
    results = evaluate_passkey(fake_model, tokenizer, [300], num_depths=3, progress=False, keys=keys)
    assert not set(first_keys[:2]) & set(results.passkeys[0])
    assert (results.keys_in_training, results.keys_redrawn) == (0, 2)
    assert "0 of them in the training data (2 drawn again" in results.describe_keys()


def test_no_key_is_used_twice_across_lengths_and_depths(tokenizer, fake_model):
    """Two-digit keys (90 of them): 60 draws would repeat some by chance; none may repeat."""
    results = evaluate_passkey(fake_model, tokenizer, [200, 300, 400], num_depths=20, num_digits=2, progress=False)
    keys = [key for row in results.passkeys for key in row]
    assert len(keys) == 60 and len(set(keys)) == 60


def test_a_shared_drawer_keeps_keys_new_across_calls(tokenizer, fake_model):
    keys = PasskeyKeys(seed=1, num_digits=2)
    rows = [evaluate_passkey(fake_model, tokenizer, [length], num_depths=30, progress=False, keys=keys).passkeys[0]
            for length in (200, 300)]
    assert len(set(rows[0] + rows[1])) == 60


def test_each_seed_draws_its_own_keys_and_the_same_seed_the_same(tokenizer, fake_model):
    """Twenty seeds draw twenty different sequences of keys, a fresh drawer of the same seed the same one again, and
    none is the training stream of its seed (`random.Random(seed)`); `evaluate_passkey`'s own drawer follows its
    `seed` as well."""
    def sequence(seed):
        keys = PasskeyKeys(seed=seed, num_digits=5)
        return [keys.draw() for _ in range(8)]

    sequences = {seed: sequence(seed) for seed in range(20)}
    assert len({tuple(keys) for keys in sequences.values()}) == 20
    assert all(sequence(seed) == keys for seed, keys in sequences.items())
    for seed, keys in sequences.items():
        training = random.Random(seed)
        assert keys != [random_passkey(training, 5) for _ in range(8)], f"seed {seed}: the training stream"
    evaluated = {seed: evaluate_passkey(fake_model, tokenizer, [200], num_depths=4, seed=seed, progress=False).passkeys
                 for seed in (0, 1, 2)}
    assert evaluated[0] != evaluated[1] != evaluated[2] != evaluated[0]
    assert evaluated[1] == evaluate_passkey(fake_model, tokenizer, [200], num_depths=4, seed=1, progress=False).passkeys


def redraws_per_call(stream: list[str], excluded: set[str], draws: list[int]) -> list[int]:
    """How many excluded keys each call meets before its own keys, for calls drawing `draws` keys in turn from a
    stream whose keys are all different: a call's redraws are the excluded keys between the previous call's last
    key and its own last one."""
    counts, position = [], 0
    for wanted in draws:
        redrawn = 0
        while wanted:
            if stream[position] in excluded:
                redrawn += 1
            else:
                wanted -= 1
            position += 1
        counts.append(redrawn)
    return counts


def test_a_shared_drawer_reports_each_call_s_own_redraws(tokenizer, fake_model):
    """One drawer across four calls of `evaluate_passkey` (a length each, as bam-eval and the demo share one): each
    result counts the keys of the training data drawn again during its own call, not those of the calls before
    it, and its keys are the stream's next ones that the training data does not hold. A key drawn again for being
    drawn before is no key of the training data."""
    stream_drawer = PasskeyKeys(seed=3, num_digits=5, excluded=set())
    stream = [stream_drawer.draw() for _ in range(24)]
    excluded = {stream[index] for index in (0, 1, 5, 9, 10, 11, 17)}
    depths = [3, 3, 2, 4]
    keys = PasskeyKeys(seed=3, num_digits=5, excluded=excluded)
    results = [evaluate_passkey(fake_model, tokenizer, [200], num_depths=count, progress=False, keys=keys)
               for count in depths]
    assert [result.keys_redrawn for result in results] == redraws_per_call(stream, excluded, depths) == [2, 1, 3, 1]
    assert [result.keys_in_training for result in results] == [0, 0, 0, 0]
    assert sum((result.passkeys[0] for result in results), []) == [key for key in stream if key not in excluded][:12]
    assert "(1 drawn again" in results[3].describe_keys()
    # 60 of the 90 two-digit keys: the stream repeats keys, drawn again as well, but none of the training data
    keys = PasskeyKeys(seed=3, num_digits=2, excluded=set())
    results = [evaluate_passkey(fake_model, tokenizer, [200], num_depths=30, progress=False, keys=keys) for _ in "ab"]
    assert [result.keys_redrawn for result in results] == [0, 0]


# ---------------------------------------------------------------------------------------------- teacher forcing


class NextDigitModel(torch.nn.Module):
    """After a digit d it predicts the digit d + 1 (mod 10); after anything else, a space. Given the true digits of
    a key whose digits count up, it is right at every digit; greedy, it never starts the key."""

    def __init__(self, tokenizer):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, num_attention_heads=2,
                                  num_hidden_layers=1, intermediate_size=8)
        digit_ids = [tokenizer(str(digit), add_special_tokens=False)["input_ids"][0] for digit in range(10)]
        space = tokenizer(" ", add_special_tokens=False)["input_ids"][0]
        self.next_token = torch.full((len(tokenizer),), space)
        for digit, token in enumerate(digit_ids):
            self.next_token[token] = digit_ids[(digit + 1) % 10]

    def forward(self, input_ids, use_cache=False, past_key_values=None, **kwargs):
        logits = torch.nn.functional.one_hot(self.next_token[input_ids], self.config.vocab_size).float() * 10.0
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def fake_model(tokenizer):
    return NextDigitModel(tokenizer).eval()


class GivenKeys:
    """A key drawer that hands out the keys it is given, in order."""

    def __init__(self, keys):
        self.keys, self.redrawn = list(keys), 0

    def draw(self):
        return self.keys.pop(0)

    def count_in_training(self, keys):
        return None


def test_teacher_forced_scores_the_digits_after_the_first_given_the_true_ones(tokenizer, fake_model):
    """Counting-up keys: every digit after the given first one is right teacher-forced, though greedy decoding
    answers spaces. 12355: after the true 3 the model says 4, not 5: a miss."""
    keys = GivenKeys(["12345", "34567", "12355", "78901"])
    results = evaluate_passkey(fake_model, tokenizer, [300], num_depths=4, progress=False, keys=keys,
                               teacher_forced=True)
    assert results.correct == [[False, False, False, False]]
    assert results.teacher_forced == [[True, True, False, True]]
    assert results.teacher_forced_by_length() == {300: 0.75} and results.accuracy_by_length() == {300: 0.0}
    # 0/4: [0, 0.6024]; 3/4: [0.1941, 0.9937] (SciPy), whole percent rounded outwards
    assert "| 300 | 245 | 0.0 | 0-61 | 75.0 | 19-100 |" in results.to_markdown()


def test_teacher_forced_argmax_is_that_of_one_plain_forward(tokenizer):
    """On a tiny BamLlama: the digits argmax'd after the cached, chunked prompt are those of one forward of prompt
    and answer without a cache; the strict predictions are unchanged by the teacher-forced pass."""
    from helpers import randomize_prior

    from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
    from bam_llama.evaluation.passkey import build_passkey_prompt

    torch.manual_seed(0)
    model = BamLlamaForCausalLM(BamLlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, initializer_range=0.3))
    randomize_prior(model)
    model.eval()
    keys = ["24680", "13579"]
    forced = evaluate_passkey(model, tokenizer, [250], num_depths=2, chunk_size=33, progress=False,
                              keys=GivenKeys(keys), teacher_forced=True)
    strict = evaluate_passkey(model, tokenizer, [250], num_depths=2, chunk_size=33, progress=False, keys=GivenKeys(keys))
    assert forced.predictions == strict.predictions
    for depth, key in zip((0.0, 1.0), keys):
        prompt = build_passkey_prompt(tokenizer, 250, depth, key)
        answer = tokenizer(" " + key, add_special_tokens=False)["input_ids"]  # a space and one byte per digit
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0]
        # the token at index len(prompt) + i is predicted at len(prompt) + i - 1; the space and first digit are given
        argmax = [int(logits[len(prompt) + index - 1].argmax()) for index in range(2, len(answer))]
        assert forced.teacher_forced[0][keys.index(key)] == (argmax == answer[2:])


# ---------------------------------------------------------------------------------------------- perplexity


class KnownLossModel(torch.nn.Module):
    """After token x it puts probability exp(-0.1 (x + 1)) on token x + 1 (the rest spread evenly): on the
    documents 2, 3, 4, ... behind BOS = 1, the token at position i costs exactly 0.1 (i + 2)."""

    VOCAB = 64

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = LlamaConfig(vocab_size=self.VOCAB, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
                                  intermediate_size=8)
        table = torch.zeros(self.VOCAB, self.VOCAB, dtype=torch.float64)
        for token in range(self.VOCAB - 1):
            right = math.exp(-0.1 * (token + 1))
            table[token] = (1 - right) / (self.VOCAB - 1)
            table[token, token + 1] = right
        table[-1] = 1 / self.VOCAB
        self.log_table = table.log().float()

    def forward(self, input_ids, use_cache=False, past_key_values=None, **kwargs):
        return SimpleNamespace(logits=self.log_table[input_ids])


def test_position_matched_perplexity_counts_exactly_the_named_positions():
    documents = {"a": list(range(2, 42)), "b": list(range(2, 22))}  # 40 and 20 tokens; token i is i + 2
    tokenizer = SimpleNamespace(bos_token_id=1)
    model = KnownLossModel().eval()
    train_length = 4
    # loss at position i is 0.1 (i + 2); past: positions [4, L); last window: [L - 4, L)
    expected = {4: (None, 3.5), 8: (7.5, 7.5), 16: (11.5, 15.5)}  # mean (i + 2) over those positions
    for length, (past, window) in expected.items():
        result = position_matched_perplexity(model, tokenizer, documents, length, train_length, chunk_size=3)
        assert result["documents"] == 2
        assert result["last_window"]["perplexity"] == pytest.approx(math.exp(0.1 * window), rel=1e-5)
        assert result["last_window"]["tokens"] == 2 * train_length
        if past is None:
            assert result["past_training_length"] is None
        else:
            assert result["past_training_length"]["perplexity"] == pytest.approx(math.exp(0.1 * past), rel=1e-5)
            assert result["past_training_length"]["tokens"] == 2 * (length - train_length)
    with pytest.raises(ValueError, match="b"):
        position_matched_perplexity(model, tokenizer, documents, 32, train_length)  # b has 20 tokens


def test_position_matched_perplexity_of_a_real_model_is_that_of_plain_forwards():
    """A tiny BamLlama, chunked through its cache: each document behind BOS in one uncached forward, the losses of
    positions [4, 12) and [8, 12) averaged over both documents."""
    from helpers import tiny_model

    tokenizer = build_byte_tokenizer()
    model = tiny_model("eager", vocab_size=len(tokenizer))
    generator = torch.Generator().manual_seed(5)
    documents = {name: torch.randint(3, len(tokenizer), (size,), generator=generator).tolist() for name, size in (("a", 12), ("b", 20))}
    past, window = [], []
    with torch.no_grad():
        for tokens in documents.values():
            sequence = torch.tensor([[tokenizer.bos_token_id, *tokens[:12]]])
            losses = torch.nn.functional.cross_entropy(model(input_ids=sequence).logits[0, :-1].double(), sequence[0, 1:], reduction="none")
            past += losses[4:].tolist()
            window += losses[8:].tolist()
    result = position_matched_perplexity(model, tokenizer, documents, 12, 4, chunk_size=5)
    assert result["past_training_length"]["perplexity"] == pytest.approx(math.exp(sum(past) / len(past)), rel=1e-5)
    assert result["last_window"]["perplexity"] == pytest.approx(math.exp(sum(window) / len(window)), rel=1e-5)
