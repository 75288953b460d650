from textkit.slug import slugify


def test_simple():
    assert slugify("hello") == "hello"


def test_lowercase():
    assert slugify("Hello World") == "hello-world"


def test_punctuation():
    assert slugify("  Stadium: serve envs, fast!  ") == "stadium-serve-envs-fast"
