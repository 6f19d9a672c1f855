"""A SymPy fallback for math answers that never executes the answer.

``sympy.sympify``/``parse_expr`` call ``eval``; here the answer is parsed with Python's ``ast``
into a whitelist (numbers, + − × ÷ ^, unary minus, a few symbols and functions) and the SymPy
expression is built node by node. Exponents are capped so ``9^9^9`` cannot eat the machine.
"""
from __future__ import annotations

import ast
import re

MAX_EXPONENT = 1000
MAX_NODES = 200
FUNCS = {"sqrt", "sin", "cos", "tan", "log", "exp", "Abs"}
SYMBOLS = {"pi", "e", "x", "y", "z", "a", "b", "c", "n", "k"}


class Unsafe(ValueError):
    pass


def latex_to_py(s: str) -> str:
    s = s.strip().strip("$").replace("\\left", "").replace("\\right", "").replace("\\cdot", "*").replace("\\times", "*")
    s = s.replace("\\pi", "pi").replace("\\div", "/").replace("^", "**").replace("{", "(").replace("}", ")")
    s = re.sub(r"\\d?frac\s*\(([^()]*)\)\s*\(([^()]*)\)", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\s*\(([^()]*)\)", r"sqrt(\1)", s)
    s = s.replace("\\", "")
    s = re.sub(r"(\d)\s*([a-z(])", r"\1*\2", s)        # 2x → 2*x, 2(…) → 2*(…)
    return s.replace(",", "")


def to_sympy(text: str):
    import sympy

    tree = ast.parse(latex_to_py(text), mode="eval")
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise Unsafe(f"expression too large ({nodes} nodes)")

    def build(n):
        if isinstance(n, ast.Expression):
            return build(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return sympy.Rational(str(n.value)) if isinstance(n.value, float) else sympy.Integer(n.value)
        if isinstance(n, ast.Name) and n.id in SYMBOLS:
            return {"pi": sympy.pi, "e": sympy.E}.get(n.id, sympy.Symbol(n.id))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = build(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp):
            a, b = build(n.left), build(n.right)
            if isinstance(n.op, ast.Add):
                return a + b
            if isinstance(n.op, ast.Sub):
                return a - b
            if isinstance(n.op, ast.Mult):
                return a * b
            if isinstance(n.op, ast.Div):
                return a / b
            if isinstance(n.op, ast.Pow):
                if b.is_number and abs(float(b)) > MAX_EXPONENT:
                    raise Unsafe("exponent too large")
                if not b.is_number:
                    raise Unsafe("symbolic exponent")
                return a ** b
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in FUNCS and len(n.args) == 1:
            return getattr(sympy, n.func.id)(build(n.args[0]))
        raise Unsafe(f"not allowed: {type(n).__name__}")

    return build(tree)


def sympy_equal(pred: str, gold: str) -> bool:
    import sympy

    a, b = to_sympy(pred), to_sympy(gold)
    d = sympy.simplify(a - b)
    if d == 0:
        return True
    if d.is_number:
        return abs(complex(d.evalf())) < 1e-9 * max(1.0, abs(complex(b.evalf())) if b.is_number else 1.0)
    return False
