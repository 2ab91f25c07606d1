#!/usr/bin/python3
"""Draw the panels of the Grafana dashboard idem.json from recorded scrapes.

    render.py SAMPLES OUT.png [DASHBOARD]    draw every panel into a PNG
    render.py --metrics [DASHBOARD]          print the metric names the
                                             dashboard's queries read

SAMPLES holds the exporter's /metrics pages, each after a line
"# scrape UNIX_TIME" (contrib/grafana/record.sh writes it).  Each panel's
PromQL expressions are evaluated at every scrape, as Prometheus would for
a range query with a step of one scrape, by the small PromQL subset below
(selectors with label matchers, rate, increase, sum/max/min/avg by, + - *
/ and numbers); the dashboard's variables are taken as "All", and
$__rate_interval as RATE_INTERVAL seconds (default 20).  An expression
outside the subset is an error, so the picture shows the dashboard's
queries and nothing else.  Needs python3-matplotlib (Debian).
"""

import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RATE_INTERVAL = float(os.environ.get("RATE_INTERVAL", "20"))


# --- PromQL subset -------------------------------------------------------

TOKEN = re.compile(r"""
    \s*(?:
      (?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
    | (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<range>\[[^\]]*\])
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<op>=~|!~|!=|[-+*/(){},=])
    )""", re.X)

AGGREGATIONS = {"sum", "max", "min", "avg"}
FUNCTIONS = {"rate", "increase"}


class PromQLError(Exception):
    pass


def tokenize(text):
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise PromQLError("cannot read %r at %r" % (text, text[pos:]))
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def duration(text, variables):
    text = text.strip("[]").strip()
    if text in variables:
        return float(variables[text])
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", text)
    if not m:
        raise PromQLError("unknown duration " + text)
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


class Parser:
    """Parses an expression into nested tuples:
    ("num", x) ("sel", name, matchers, range_or_None) ("call", f, arg)
    ("agg", op, by_labels, arg) ("bin", op, left, right)."""

    def __init__(self, text, variables):
        self.toks = tokenize(text)
        self.i = 0
        self.variables = variables

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, value=None, kind=None):
        tok = self.peek()
        if (value is not None and tok[1] != value) or (kind is not None and tok[0] != kind):
            raise PromQLError("expected %s, found %r" % (value or kind, tok[1]))
        self.i += 1
        return tok[1]

    def parse(self):
        e = self.expr()
        if self.i != len(self.toks):
            raise PromQLError("trailing %r" % (self.peek()[1],))
        return e

    def expr(self):
        left = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()
            left = ("bin", op, left, self.term())
        return left

    def term(self):
        left = self.factor()
        while self.peek() in (("op", "*"), ("op", "/")):
            op = self.take()
            left = ("bin", op, left, self.factor())
        return left

    def factor(self):
        kind, value = self.peek()
        if kind == "num":
            self.take()
            return ("num", float(value))
        if (kind, value) == ("op", "("):
            self.take()
            e = self.expr()
            self.take(")")
            return e
        if kind != "ident":
            raise PromQLError("unexpected %r" % (value,))
        self.take()
        if value in AGGREGATIONS:
            by = None
            if self.peek() == ("ident", "by"):
                self.take()
                by = self.labels()
            self.take("(")
            arg = self.expr()
            self.take(")")
            if by is None and self.peek() == ("ident", "by"):
                self.take()
                by = self.labels()
            return ("agg", value, tuple(by or ()), arg)
        if value in FUNCTIONS:
            self.take("(")
            arg = self.expr()
            self.take(")")
            if arg[0] != "sel" or arg[3] is None:
                raise PromQLError(value + "() needs a range selector")
            return ("call", value, arg)
        if self.peek() == ("op", "("):
            raise PromQLError("function %s is not in the subset" % value)
        return self.selector(value)

    def labels(self):
        self.take("(")
        names = []
        while self.peek() != ("op", ")"):
            names.append(self.take(kind="ident"))
            if self.peek() == ("op", ","):
                self.take()
        self.take(")")
        return names

    def selector(self, name):
        matchers = []
        if self.peek() == ("op", "{"):
            self.take()
            while self.peek() != ("op", "}"):
                label = self.take(kind="ident")
                op = self.take(kind="op")
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError("bad matcher " + op)
                value = json.loads(self.take(kind="str"))
                for var, val in self.variables.items():
                    value = value.replace(var, val)
                matchers.append((label, op, value))
                if self.peek() == ("op", ","):
                    self.take()
            self.take("}")
        rng = None
        if self.peek()[0] == "range":
            rng = duration(self.take(), self.variables)
        return ("sel", name, tuple(matchers), rng)


def metric_names(node):
    if node[0] == "sel":
        return {node[1]}
    if node[0] == "call":
        return metric_names(node[2])
    if node[0] == "agg":
        return metric_names(node[3])
    if node[0] == "bin":
        return metric_names(node[2]) | metric_names(node[3])
    return set()


def matches(labels, matchers):
    for label, op, value in matchers:
        have = labels.get(label, "")
        if op == "=" and have != value or op == "!=" and have == value:
            return False
        if op == "=~" and not re.fullmatch(value, have):
            return False
        if op == "!~" and re.fullmatch(value, have):
            return False
    return True


class Samples:
    """Scrapes: times[i] and, per metric name, {labels: [value per scrape]}."""

    def __init__(self, path):
        self.times = []
        self.series = {}
        line_re = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
        label_re = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
        with open(path) as f:
            for line in f:
                if line.startswith("# scrape "):
                    self.times.append(float(line.split()[2]))
                    continue
                if line.startswith("#") or not line.strip() or not self.times:
                    continue
                m = line_re.match(line)
                if not m:
                    continue
                labels = tuple(sorted(label_re.findall(m.group(3) or "")))
                per = self.series.setdefault(m.group(1), {})
                values = per.setdefault(labels, [])
                values.extend([math.nan] * (len(self.times) - 1 - len(values)))
                values.append(float(m.group(4)))
        for per in self.series.values():
            for values in per.values():
                values.extend([math.nan] * (len(self.times) - len(values)))

    def instant(self, name, matchers, i):
        out = {}
        for labels, values in self.series.get(name, {}).items():
            if matches(dict(labels), matchers) and not math.isnan(values[i]):
                out[labels] = values[i]
        return out

    def rate(self, name, matchers, i, window, increase):
        out = {}
        t = self.times[i]
        first = i
        while first > 0 and self.times[first - 1] > t - window:
            first -= 1
        for labels, values in self.series.get(name, {}).items():
            if not matches(dict(labels), matchers):
                continue
            pts = [(self.times[j], values[j]) for j in range(first, i + 1)
                   if not math.isnan(values[j])]
            if len(pts) < 2:
                continue
            delta = 0.0
            for (_, a), (_, b) in zip(pts, pts[1:]):
                delta += b - a if b >= a else b  # a counter reset
            per_second = delta / (pts[-1][0] - pts[0][0])
            out[labels] = per_second * window if increase else per_second
        return out


def evaluate(node, samples, i):
    """An instant vector {labels (sorted tuple, no __name__): value}, or a float."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "sel":
        if node[3] is not None:
            raise PromQLError("a range selector outside rate()")
        return samples.instant(node[1], node[2], i)
    if kind == "call":
        sel = node[2]
        return samples.rate(sel[1], sel[2], i, sel[3], node[1] == "increase")
    if kind == "agg":
        arg = evaluate(node[3], samples, i)
        groups = {}
        for labels, v in arg.items():
            key = tuple((k, val) for k, val in labels if k in node[2])
            groups.setdefault(key, []).append(v)
        fn = {"sum": sum, "max": max, "min": min,
              "avg": lambda v: sum(v) / len(v)}[node[1]]
        return {k: fn(v) for k, v in groups.items()}
    if kind == "bin":
        left = evaluate(node[2], samples, i)
        right = evaluate(node[3], samples, i)
        op = node[1]

        def apply(a, b):
            if op == "+":
                return a + b
            if op == "-":
                return a - b
            if op == "*":
                return a * b
            if b == 0:
                return math.nan if a == 0 else math.copysign(math.inf, a)
            return a / b
        if isinstance(left, float) and isinstance(right, float):
            return apply(left, right)
        if isinstance(left, float):
            return {k: apply(left, v) for k, v in right.items()}
        if isinstance(right, float):
            return {k: apply(v, right) for k, v in left.items()}
        return {k: apply(v, right[k]) for k, v in left.items() if k in right}
    raise PromQLError("cannot evaluate " + kind)


# --- the dashboard -------------------------------------------------------

def load_dashboard(path):
    with open(path) as f:
        dash = json.load(f)
    variables = {"$__rate_interval": str(RATE_INTERVAL)}
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            variables["$" + v["name"]] = ".*"
    panels = []
    for p in dash["panels"]:
        targets = []
        for t in p.get("targets", []):
            targets.append((Parser(t["expr"], variables).parse(), t.get("legendFormat", "")))
        panels.append((p, targets))
    return dash, panels


def legend(fmt, labels):
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt).strip()


def unit_format(unit):
    def fmt(v, _pos=None):
        if unit == "bytes":
            for size, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
                if abs(v) >= size:
                    return "%g %s" % (round(v / size, 1), suffix)
            return "%g B" % v
        if unit == "s":
            if v == 0:
                return "0"
            if abs(v) < 1:
                return "%g ms" % round(v * 1000, 2)
            return "%g s" % round(v, 1)
        if unit == "reqps":
            return "%g/s" % round(v, 1)
        return "%g" % round(v, 2)
    return fmt


def render(samples_path, out, dash_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    dash, panels = load_dashboard(dash_path)
    samples = Samples(samples_path)
    if len(samples.times) < 2:
        raise SystemExit("render.py: fewer than two scrapes in " + samples_path)
    t0 = samples.times[0]
    xs = [t - t0 for t in samples.times]
    cols = 2
    rows = math.ceil(len(panels) / cols)
    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9,
                         "axes.titleweight": "bold", "legend.fontsize": 7})
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.0 * rows + 0.6))
    for ax, (p, targets) in zip(axes.flat, panels):
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        for node, fmt in targets:
            series = {}
            for i in range(len(samples.times)):
                value = evaluate(node, samples, i)
                if isinstance(value, float):
                    value = {(): value}
                for labels, v in value.items():
                    series.setdefault(labels, [math.nan] * len(xs))[i] = v
            for labels, ys in sorted(series.items()):
                ys = [y if math.isfinite(y) else math.nan for y in ys]
                ax.plot(xs, ys, linewidth=1.2, label=legend(fmt, labels))
        ax.set_title(p["title"], loc="left")
        ax.set_ylim(bottom=0)
        if ax.get_ylim()[1] < 1e-9 or not any(
                any(math.isfinite(y) and y > 0 for y in line.get_ydata()) for line in ax.lines):
            ax.set_ylim(0, 1)  # nothing above zero: an axis of 0 to 1, not of 0 to 0.05
        ax.set_xlim(0, xs[-1])
        ax.yaxis.set_major_formatter(FuncFormatter(unit_format(unit)))
        ax.grid(True, linewidth=0.4, alpha=0.5)
        ax.tick_params(axis="x", labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            # Below the graph, as Grafana puts it.
            ax.legend(loc="upper left", bbox_to_anchor=(0, -0.1), ncol=3,
                      frameon=False, handlelength=1.5, columnspacing=1.2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("%s dashboard (%s): its panels drawn from %d scrapes of prometheus-postgres-exporter, "
                 "one a second; x: seconds into the run; $__rate_interval = %gs"
                 % (dash["title"], os.path.basename(dash_path), len(samples.times), RATE_INTERVAL),
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=90)
    try:
        # A palette of 64 colours keeps the PNG small; the lines are flat
        # colours anyway.
        from PIL import Image
        Image.open(out).convert("RGB").quantize(64).save(out, optimize=True)
    except ImportError:
        pass


def main(argv):
    if len(argv) >= 1 and argv[0] == "--metrics":
        _, panels = load_dashboard(argv[1] if len(argv) > 1 else os.path.join(HERE, "idem.json"))
        names = set()
        for _, targets in panels:
            for node, _ in targets:
                names |= metric_names(node)
        print("\n".join(sorted(names)))
        return 0
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    render(argv[0], argv[1], argv[2] if len(argv) == 3 else os.path.join(HERE, "idem.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
