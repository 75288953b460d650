# ruff: noqa: PT009 - a unittest suite, as the task's repository has it
import unittest

from calc import absolute, clamp


class TestAbsolute(unittest.TestCase):
    def test_positive(self):
        self.assertEqual(absolute(3), 3)

    def test_negative(self):
        self.assertEqual(absolute(-4), 4)
        self.assertEqual(absolute(-0.5), 0.5)


class TestClamp(unittest.TestCase):
    def test_inside(self):
        self.assertEqual(clamp(5, 0, 10), 5)

    def test_outside(self):
        self.assertEqual(clamp(-1, 0, 10), 0)
        self.assertEqual(clamp(11, 0, 10), 10)


if __name__ == "__main__":
    unittest.main()
