"""Synthetic training prompts: competition-style math problems written in LaTeX.

The offline training files (docs/DATA.md) hold grade-school math (GSM8K), whose
answers carry almost none of the LaTeX that competition math is written in
(MATH500, AIME): in the result preset ~15-18 % of the speculative rounds on those
benchmarks start from a token the drafters never saw in training, and position-1
acceptance there is half of what it is elsewhere (docs/RESULTS.md). The paper's
training mix (open-perfectblend) holds competition math; the offline stand-in is
this generator: problems across the seven subjects of the MATH dataset (prealgebra,
algebra, counting and probability, number theory, geometry, intermediate algebra,
precalculus), each a template with random numbers, written as those benchmarks
write them, with the Math benchmarks' instruction. The target answers them in
regeneration, so the drafters learn the target's own LaTeX.

A source ``synthetic:competition-math`` in ``data.train`` takes ``cap`` distinct
prompts, deterministic in ``data.seed``: draw ``i`` comes from its own
``random.Random(f"{seed}:{i}")`` stream, so a larger cap keeps the smaller cap's prompts.
No template is taken from a benchmark; `tests/test_synthetic.py` checks that no
generated problem repeats a benchmark prompt.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Callable

from ..errors import DeepSpecError

# the Math benchmarks' instruction (DeepSpec's eval_datasets converter)
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."

NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jamal", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
WORDS = ["BANANA", "LEVEL", "MISSISSIPPI", "COMMITTEE", "PEPPER", "BALLOON", "STATISTICS", "ALGEBRA",
         "PARALLEL", "TOMATO", "ROTATOR", "GEOMETRY", "COOKBOOK", "LETTER", "SUCCESS"]


def _frac(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


def _signed(c: int, var: str = "", first: bool = False) -> str:
    """A polynomial term: '+ 3x', '- x', '7' (first)."""
    mag = abs(c)
    body = (str(mag) if mag != 1 or not var else "") + var
    if first:
        return ("-" if c < 0 else "") + body
    return (" - " if c < 0 else " + ") + body


def _poly(coeffs: list[int], var: str = "x") -> str:
    """coeffs from the highest degree down; zero terms left out."""
    deg = len(coeffs) - 1
    out = ""
    for i, c in enumerate(coeffs):
        if c == 0:
            continue
        p = deg - i
        v = "" if p == 0 else var if p == 1 else f"{var}^{{{p}}}" if p > 9 else f"{var}^{p}"
        out += _signed(c, v, first=not out)
    return out or "0"


def _nonzero(r: random.Random, lo: int, hi: int) -> int:
    while True:
        v = r.randint(lo, hi)
        if v:
            return v


def _vec(xs) -> str:
    return "\\begin{pmatrix} " + " \\\\ ".join(str(x) for x in xs) + " \\end{pmatrix}"


def _mat(rows) -> str:
    return "\\begin{pmatrix} " + " \\\\ ".join(" & ".join(str(x) for x in row) for row in rows) + " \\end{pmatrix}"


# ---------------------------------------------------------------- prealgebra

def fraction_sum(r):
    a, b, c, d = r.randint(1, 9), r.randint(2, 12), r.randint(1, 9), r.randint(2, 12)
    op = r.choice(["+", "-"])
    return f"What is ${_frac(Fraction(a, b))} {op} {_frac(Fraction(c, d))}$? Express your answer as a common fraction."


def percent_of(r):
    p, q = r.choice([5, 12, 15, 20, 25, 35, 40, 60, 75, 120, 150]), r.randint(2, 60) * 4
    return f"What is ${p}\\%$ of ${q}$?"


def mean_missing(r):
    vals = [r.randint(40, 99) for _ in range(r.randint(3, 5))]
    m = r.randint(60, 90)
    listed = ", ".join(f"${v}$" for v in vals)
    return (f"{r.choice(NAMES)}'s scores on the first {len(vals)} tests were {listed}. What score does "
            f"{'she' if r.random() < 0.5 else 'he'} need on the next test to make the mean of all "
            f"{len(vals) + 1} scores equal ${m}$?")


def rectangle(r):
    w, extra = r.randint(2, 20), r.randint(1, 15)
    return (f"A rectangle's length is ${extra}$ units more than its width, and its perimeter is "
            f"${2 * (2 * w + extra)}$ units. What is the area of the rectangle, in square units?")


def exponent_expr(r):
    b, m, n, k = r.choice([2, 3, 5, 10]), r.randint(2, 9), r.randint(2, 9), r.randint(1, 6)
    return f"Simplify $\\frac{{{b}^{{{m}}} \\cdot {b}^{{{n}}}}}{{{b}^{{{m + n - k}}}}}$."


def order_ops(r):
    a, b, c, d, e = (r.randint(2, 12) for _ in range(5))
    return f"Compute $({a} + {b})^2 - {c} \\cdot {d} \\div {e} \\times {e}$."


# ---------------------------------------------------------------- algebra

def linear_eq(r):
    a, c = _nonzero(r, -9, 9), _nonzero(r, -9, 9)
    while a == c:
        c = _nonzero(r, -9, 9)
    b, d = r.randint(-30, 30), r.randint(-30, 30)
    return f"Solve for $x$: ${_poly([a, b])} = {_poly([c, d])}$."


def quadratic_roots(r):
    p, q = r.randint(-12, 12), r.randint(-12, 12)
    a = r.choice([1, 1, 2, 3])
    what = r.choice(["the sum of the solutions", "the product of the solutions", "the positive difference between the solutions"])
    return f"What is {what} of the equation ${_poly([a, -a * (p + q), a * p * q])} = 0$?"


def function_compose(r):
    a, b, c, d = _nonzero(r, -5, 5), r.randint(-9, 9), _nonzero(r, -4, 4), r.randint(-9, 9)
    k = r.randint(-5, 5)
    return (f"Let $f(x) = {_poly([a, b])}$ and $g(x) = {_poly([c, 0, d])}$. What is $f(g({k}))$?")


def slope_line(r):
    x1, y1, x2, y2 = (r.randint(-10, 10) for _ in range(4))
    while x1 == x2:
        x2 = r.randint(-10, 10)
    what = r.choice(["slope", "$y$-intercept"])
    return (f"What is the {what} of the line that passes through the points $({x1}, {y1})$ and $({x2}, {y2})$? "
            "Express your answer as a common fraction if necessary.")


def distance_points(r):
    x1, y1 = r.randint(-9, 9), r.randint(-9, 9)
    dx, dy = r.choice([(3, 4), (5, 12), (8, 15), (6, 8), (7, 24), (2, 3), (1, 5), (4, 7)])
    return f"What is the distance between the points $({x1}, {y1})$ and $({x1 + dx}, {y1 - dy})$? Express your answer in simplest radical form."


def system_eq(r):
    x, y = r.randint(-8, 8), r.randint(-8, 8)
    a, b, c, d = _nonzero(r, -6, 6), _nonzero(r, -6, 6), _nonzero(r, -6, 6), _nonzero(r, -6, 6)
    while a * d == b * c:
        d = _nonzero(r, -6, 6)
    return (f"If ${_poly([a, 0])}{_signed(b, 'y')} = {a * x + b * y}$ and "
            f"${_poly([c, 0])}{_signed(d, 'y')} = {c * x + d * y}$, what is the value of $x + y$?")


def simplify_radical(r):
    s, f = r.randint(2, 12), r.choice([2, 3, 5, 6, 7, 10, 11])
    t = r.randint(2, 9)
    return f"Simplify $\\sqrt{{{s * s * f}}} + \\sqrt{{{t * t * f}}}$."


def exponential_eq(r):
    b = r.choice([2, 3])
    m, n = r.randint(1, 6), r.randint(1, 6)
    return f"Solve for $x$: ${b}^{{x + {m}}} = {b * b}^{{{n}}} \\cdot {b}^{{x - {m}}} \\cdot {b}^{{x}}$."


def floor_ceil(r):
    a, b, c, d = r.randint(10, 99), r.randint(3, 9), r.randint(10, 99), r.randint(3, 9)
    return f"Evaluate $\\left\\lceil \\frac{{{a}}}{{{b}}} \\right\\rceil + \\left\\lfloor -\\frac{{{c}}}{{{d}}} \\right\\rfloor$."


def arithmetic_seq(r):
    a, d, n = r.randint(-20, 20), _nonzero(r, -9, 9), r.randint(10, 60)
    what = r.choice([f"the ${n}$th term", f"the sum of the first ${n}$ terms"])
    return f"What is {what} of the arithmetic sequence ${a}, {a + d}, {a + 2 * d}, \\ldots$?"


# ---------------------------------------------------------------- counting and probability

def committee(r):
    n, k = r.randint(6, 16), r.randint(2, 5)
    role = r.choice(["a committee of", "a team of", "a group of"])
    return f"In how many ways can {role} ${k}$ people be chosen from a club of ${n}$ people?"


def committee_officers(r):
    n = r.randint(6, 20)
    return (f"Our club has ${n}$ members. In how many ways can we choose a president, a vice-president and a "
            "treasurer, if no member can hold more than one office?")


def dice_sum(r):
    s = r.choice([4, 6, 8])
    t = r.randint(3, 2 * s - 1)
    return (f"Two fair ${s}$-sided dice, with faces numbered $1$ through ${s}$, are rolled. What is the probability "
            f"that the sum of the numbers rolled is ${t}$? Express your answer as a common fraction.")


def word_arrangements(r):
    return f"How many distinct arrangements of the letters in the word {r.choice(WORDS)} are there?"


def marbles(r):
    red, blue = r.randint(2, 9), r.randint(2, 9)
    both = r.choice(["both red", "of different colors", "both the same color"])
    return (f"A bag contains ${red}$ red marbles and ${blue}$ blue marbles. Two marbles are drawn at random "
            f"without replacement. What is the probability that they are {both}? Express your answer as a common fraction.")


def binomial_coefficient(r):
    n, a = r.randint(4, 10), r.choice([-3, -2, -1, 2, 3, 5])
    k = r.randint(1, n - 1)
    return f"What is the coefficient of $x^{{{k}}}$ in the expansion of $(x{_signed(a)})^{{{n}}}$?"


def inclusion_exclusion(r):
    n, a, b = r.choice([100, 200, 500, 1000]), r.choice([3, 4, 6]), r.choice([5, 7, 9, 11])
    return (f"How many positive integers less than ${n}$ are multiples of ${a}$ or ${b}$, "
            "but not both at once?")


def coins(r):
    n = r.randint(4, 10)
    k = r.randint(1, n - 1)
    return (f"A fair coin is flipped ${n}$ times. What is the probability that it lands heads exactly ${k}$ times? "
            "Express your answer as a common fraction.")


# ---------------------------------------------------------------- number theory

def power_mod(r):
    a, n, m = r.randint(2, 19), r.randint(20, 2030), r.choice([5, 7, 9, 11, 13, 100, 1000])
    return f"What is the remainder when ${a}^{{{n}}}$ is divided by ${m}$?"


def divisor_count(r):
    n = r.choice([2, 3, 5, 7]) ** r.randint(1, 4) * r.choice([3, 5, 11, 13]) ** r.randint(1, 3) * r.choice([1, 7, 17])
    if r.random() < 0.5:
        return f"How many positive divisors does ${n}$ have?"
    return f"What is the sum of the positive divisors of ${n}$?"


def gcd_lcm(r):
    g = r.randint(2, 30)
    a, b = g * r.randint(2, 20), g * r.randint(2, 20)
    what = r.choice(["greatest common divisor", "least common multiple"])
    return f"What is the {what} of ${a}$ and ${b}$?"


def base_conversion(r):
    n, b = r.randint(50, 3000), r.choice([2, 3, 5, 6, 7, 8, 9])
    return f"Express ${n}_{{10}}$ in base ${b}$."


def congruence(r):
    m = r.choice([7, 11, 13, 17, 19, 23])
    a, b = r.randint(2, m - 1), r.randint(1, m - 1)
    return f"Find the smallest positive integer $x$ such that ${a}x \\equiv {b} \\pmod{{{m}}}$."


def units_digit(r):
    a, n = r.randint(2, 99), r.randint(10, 3000)
    return f"What is the units digit of ${a}^{{{n}}}$?"


def digit_sum_condition(r):
    k, m = r.randint(2, 4), r.choice([3, 7, 9, 11])
    return f"How many ${k}$-digit positive integers are divisible by ${m}$ and have all digits odd?"


# ---------------------------------------------------------------- geometry

def right_triangle(r):
    k = r.randint(1, 6)
    a, b, c = (k * x for x in r.choice([(3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29)]))
    what = r.choice(["the length of its hypotenuse", "its area", "the length of the altitude to the hypotenuse"])
    return f"A right triangle has legs of length ${a}$ and ${b}$ units. What is {what}?"


def circle_area(r):
    c = r.randint(2, 30)
    return (f"The circumference of a circle is ${c}\\pi$ centimeters. What is the area of the circle, in square "
            "centimeters? Express your answer in terms of $\\pi$.")


def triangle_angles(r):
    a, b = r.randint(20, 80), r.randint(20, 80)
    return (f"In triangle $ABC$, $\\angle A = {a}^\\circ$ and $\\angle B = {b}^\\circ$. The bisector of $\\angle C$ "
            "meets $\\overline{AB}$ at $D$. What is the measure of $\\angle ADC$, in degrees?")


def triangle_area_coords(r):
    while True:  # three points not on one line
        pts = [(r.randint(-8, 8), r.randint(-8, 8)) for _ in range(3)]
        if (pts[1][0] - pts[0][0]) * (pts[2][1] - pts[0][1]) != (pts[2][0] - pts[0][0]) * (pts[1][1] - pts[0][1]):
            break
    p = ", ".join(f"$({x}, {y})$" for x, y in pts)
    return f"What is the area, in square units, of the triangle with vertices at {p}?"


def cube_volume(r):
    s = r.randint(2, 15)
    return f"The surface area of a cube is ${6 * s * s}$ square inches. What is the volume of the cube, in cubic inches?"


def polygon_angles(r):
    n = r.choice([5, 6, 8, 9, 10, 12, 15, 18, 20, 24, 30, 36])
    angle = Fraction(180 * (n - 2), n)
    return f"Each interior angle of a regular polygon measures ${_frac(angle)}^\\circ$. How many sides does the polygon have?"


def cylinder(r):
    rad, h = r.randint(2, 10), r.randint(2, 15)
    what = r.choice(["volume", "total surface area"])
    return (f"A right circular cylinder has radius ${rad}$ and height ${h}$. What is its {what}? "
            "Express your answer in terms of $\\pi$.")


# ---------------------------------------------------------------- intermediate algebra

def vieta_cubic(r):
    roots = [r.randint(-6, 6) for _ in range(3)]
    s1, s2, s3 = sum(roots), roots[0] * roots[1] + roots[0] * roots[2] + roots[1] * roots[2], math.prod(roots)
    what = r.choice(["$a + b + c$", "$a^2 + b^2 + c^2$", "$\\frac{1}{a} + \\frac{1}{b} + \\frac{1}{c}$", "$abc$"])
    return f"Let $a$, $b$, and $c$ be the roots of ${_poly([1, -s1, s2, -s3])} = 0$. Compute {what}."


def remainder_theorem(r):
    n, a = r.randint(5, 100), _nonzero(r, -3, 3)
    c = [r.randint(-9, 9) for _ in range(3)]
    return (f"Find the remainder when $x^{{{n}}}{_signed(c[0], 'x^2')}{_signed(c[1], 'x')}{_signed(c[2]) if c[2] else ''}$ "
            f"is divided by $x{_signed(-a)}$.")


def telescoping(r):
    n = r.randint(10, 200)
    kind = r.choice([f"\\sum_{{k=1}}^{{{n}}} \\frac{{1}}{{k(k+1)}}", f"\\sum_{{k=1}}^{{{n}}} k^2",
                     f"\\sum_{{k=2}}^{{{n}}} \\log_{{2}}\\left(1 + \\frac{{1}}{{k}}\\right)"])
    return f"Compute $${kind}.$$"


def abs_inequality(r):
    a, b = r.randint(-10, 10), r.randint(1, 12)
    k = _nonzero(r, -4, 4)
    return f"Find all real numbers $x$ such that $|{_poly([k, -a])}| \\le {b}$. Express your answer in interval notation."


def complex_arith(r):
    a, b, c, d = (_nonzero(r, -9, 9) for _ in range(4))
    op = r.choice(["product", "quotient"])
    if op == "product":
        return f"Simplify $({a}{_signed(b, 'i')})({c}{_signed(d, 'i')})$, where $i^2 = -1$."
    return f"Simplify $\\dfrac{{{a}{_signed(b, 'i')}}}{{{c}{_signed(d, 'i')}}}$. Express your answer in the form $a + bi$."


def min_quadratic(r):
    a, b, c = r.randint(1, 5), r.randint(-20, 20), r.randint(-30, 30)
    return f"What is the minimum value of ${_poly([a, b, c])}$ over all real numbers $x$?"


def logarithm(r):
    b, k = r.choice([2, 3, 4, 5, 8, 9, 16, 27]), r.randint(2, 6)
    m = r.randint(2, 5)
    return f"Evaluate $\\log_{{{b}}} {b ** m} + \\log_{{{b}}} \\sqrt[{k}]{{{b}}}$."


def geometric_series(r):
    a, p, q = r.randint(1, 20), r.randint(1, 4), r.randint(2, 7)
    if p >= q:
        p = q - 1
    return (f"Evaluate the infinite geometric series $${a} + {_frac(Fraction(a * p, q))} + "
            f"{_frac(Fraction(a * p * p, q * q))} + \\cdots.$$")


def functional_eq(r):
    a, b = _nonzero(r, -5, 5), r.randint(-9, 9)
    k = r.randint(2, 9)
    return (f"The function $f$ satisfies $f(x) + {abs(a) + 1}f(1 - x) = {_poly([a, b])}$ for all real numbers $x$. "
            f"Find $f({k})$.")


# ---------------------------------------------------------------- precalculus

def trig_value(r):
    ang = r.choice([30, 45, 60, 120, 135, 150, 210, 225, 240, 300, 315, 330])
    fn = r.choice(["\\sin", "\\cos", "\\tan"])
    return f"Compute ${fn} {ang}^\\circ$."


def double_angle(r):
    p, q = r.randint(1, 6), r.randint(7, 13)
    what = r.choice(["\\cos 2\\theta", "\\sin^2 \\theta", "\\cos 3\\theta"])
    return f"If $\\cos \\theta = \\frac{{{p}}}{{{q}}}$, then find ${what}$."


def polar(r):
    x, y = r.choice([(1, 1), (0, 3), (-2, 2), (3, -3), (-4, 0), (1, -1), (0, -5)])
    k = r.randint(1, 4)
    return (f"Convert the point $({k * x}, {k * y})$ in rectangular coordinates to polar coordinates. Enter your "
            "answer in the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$")


def matrix_product(r):
    m = [[r.randint(-5, 5) for _ in range(2)] for _ in range(2)]
    v = [r.randint(-5, 5) for _ in range(2)]
    return f"Compute ${_mat(m)} {_vec(v)}.$"


def determinant(r):
    n = r.choice([2, 3])
    m = [[r.randint(-6, 6) for _ in range(n)] for _ in range(n)]
    return f"Compute $\\det {_mat(m)}.$"


def dot_cross(r):
    u, v = [r.randint(-7, 7) for _ in range(3)], [r.randint(-7, 7) for _ in range(3)]
    what = r.choice(["Compute the dot product of", "Find the cross product of"])
    return f"{what} ${_vec(u)}$ and ${_vec(v)}.$"


# ---------------------------------------------------------------- AIME-style

def aime_pairs(r):
    n = r.randint(100, 2000)
    return (f"Find the number of ordered pairs of positive integers $(a, b)$ such that $a + b = {n}$ and neither "
            "$a$ nor $b$ has a zero digit.")


def aime_remainder(r):
    n, m = r.randint(5, 50), r.choice([1000, 100])
    return f"Let $N = \\sum_{{k=1}}^{{{n}}} k \\cdot k!$. Find the remainder when $N$ is divided by ${m}$."


def aime_fraction(r):
    a, b = r.randint(2, 9), r.randint(2, 9)
    return (f"The probability that a randomly chosen positive divisor of ${a}^{{{b}}} \\cdot {b + 1}^{{{a}}}$ is a perfect "
            "square is $\\tfrac{m}{n}$, where $m$ and $n$ are relatively prime positive integers. Find $m + n$.")


TEMPLATES: dict[str, list[Callable[[random.Random], str]]] = {
    "prealgebra": [fraction_sum, percent_of, mean_missing, rectangle, exponent_expr, order_ops],
    "algebra": [linear_eq, quadratic_roots, function_compose, slope_line, distance_points, system_eq,
                simplify_radical, exponential_eq, floor_ceil, arithmetic_seq],
    "counting_and_probability": [committee, committee_officers, dice_sum, word_arrangements, marbles,
                                 binomial_coefficient, inclusion_exclusion, coins],
    "number_theory": [power_mod, divisor_count, gcd_lcm, base_conversion, congruence, units_digit,
                      digit_sum_condition],
    "geometry": [right_triangle, circle_area, triangle_angles, triangle_area_coords, cube_volume,
                 polygon_angles, cylinder],
    "intermediate_algebra": [vieta_cubic, remainder_theorem, telescoping, abs_inequality, complex_arith,
                             min_quadratic, logarithm, geometric_series, functional_eq],
    "precalculus": [trig_value, double_angle, polar, matrix_product, determinant, dot_cross],
    "aime": [aime_pairs, aime_remainder, aime_fraction],
}


def competition_math(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` distinct problems as (subject, prompt text). Draw i takes subject i mod 8,
    a template from it and its numbers from its own random stream; a draw that
    repeats an earlier problem is skipped (the templates with few parameters)."""
    subjects = list(TEMPLATES)
    out, seen, i = [], set(), 0
    while len(out) < n:
        r = random.Random(f"{seed}:{i}")
        subject = subjects[i % len(subjects)]
        text = r.choice(TEMPLATES[subject])(r) + INSTRUCTION
        i += 1
        if text not in seen:
            seen.add(text)
            out.append((subject, text))
    return out


GENERATORS = {"competition-math": competition_math}


def synthetic_prompts(name: str, n: int, seed: int) -> list[tuple[str, str]]:
    """(subject, prompt) pairs of the generator `name`."""
    if name not in GENERATORS:
        raise DeepSpecError(f"unknown synthetic source 'synthetic:{name}' (known: "
                            + ", ".join(f"synthetic:{k}" for k in GENERATORS) + ")")
    return GENERATORS[name](n, seed)
