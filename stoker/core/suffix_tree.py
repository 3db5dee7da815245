"""A depth-bounded suffix tree of token sequences with occurrence counts (SuffixDecoding). [no torch]

Every substring of at most `max_depth` tokens of the sequences added is a path from the root; a
node's `count` is how many times its path occurs in them. So count(s + [t]) / count(s) is how
often `s` was followed by `t`: the frequency a draft of SuffixDecoding (Oliaro et al., 2024,
arXiv 2411.04975; vLLM's `suffix` method) follows, most frequent child first.

A path that occurs once is not spelled out node by node: the node where it becomes unique keeps
a `tail`, a reference (tokens, start, end) to the rest of that one occurrence, and is split one
node at a time only when a second occurrence walks into it. So a sequence of n new tokens costs
about n nodes plus the ones its repeats share, not n * max_depth (a trie of every window would
hold ~23 nodes per token of novel text at depth 24, ~6 KB per token in Python). Adding or
removing a sequence walks each of its windows once: O(n * max_depth) dict operations; a node
whose count reaches 0 on removal goes with its subtree (nothing longer occurs where it no longer does);
a path split by an occurrence that is removed later stays spelled out (removal does not re-join
it), so the tree holds at most the plain trie of what remains.
"""

from __future__ import annotations

from dataclasses import dataclass


class Node:
    __slots__ = ("count", "children", "tail")

    def __init__(self, tail: tuple[list[int], int, int] | None = None) -> None:
        self.count = 1
        self.children: dict[int, Node] | None = None
        # (tokens, start, end): this node's single occurrence continues with tokens[start:end], each
        # of count 1; only on a node of count 1 without children
        self.tail = tail if tail is not None and tail[1] < tail[2] else None


@dataclass
class Draft:
    token_ids: list[int]
    probs: list[float]  # estimated probability of each draft token (cumulative products of frequencies)
    match_len: int  # tokens of the context matched before the first draft token

    @property
    def score(self) -> float:
        """Expected accepted tokens if every estimate were right: the sum of the probabilities."""
        return sum(self.probs)


def _split(node: Node) -> None:
    """Spell out the first token of a node's tail as a real child (a second occurrence is coming)."""
    assert node.tail is not None
    tokens, start, end = node.tail
    node.tail = None
    node.children = {tokens[start]: Node((tokens, start + 1, end))}


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node()
        self.root.count = 0
        self.num_nodes = 0  # real nodes (tails not counted): for tests and memory reports

    def add(self, tokens: list[int]) -> None:
        """Add a sequence: one more occurrence of each of its substrings of at most max_depth tokens.
        The tree keeps a reference to `tokens` (tails point into it): do not change it afterwards."""
        n, depth = len(tokens), self.max_depth
        for start in range(n):
            end = min(n, start + depth)
            node = self.root
            for i in range(start, end):
                t = tokens[i]
                children = node.children
                if children is None:
                    children = node.children = {}
                child = children.get(t)
                if child is None:
                    children[t] = Node((tokens, i + 1, end))  # the rest of the window is new: one tail
                    self.num_nodes += 1
                    break
                if child.tail is not None:
                    _split(child)  # a second occurrence: its single one is spelled out a node further
                    self.num_nodes += 1
                child.count += 1
                node = child

    def remove(self, tokens: list[int]) -> None:
        """Remove a sequence added before with exactly these tokens."""
        n, depth = len(tokens), self.max_depth
        for start in range(n):
            node = self.root
            for i in range(start, min(n, start + depth)):
                t = tokens[i]
                child = node.children.get(t) if node.children else None
                assert child is not None, "removing a sequence that was not added"
                child.count -= 1
                if child.count == 0:
                    del node.children[t]  # type: ignore[union-attr]
                    self.num_nodes -= _size(child)
                    break  # the rest of this window lay below it
                node = child

    def walk(self, path: list[int]) -> tuple[Node, int] | None:
        """Where `path` ends: a node and how many tokens of its tail were walked; None if it does not occur."""
        node, off = self.root, 0
        for t in path:
            if node.tail is not None:
                tokens, start, end = node.tail
                if start + off < end and tokens[start + off] == t:
                    off += 1
                    continue
                return None
            nxt = node.children.get(t) if node.children else None
            if nxt is None:
                return None
            node = nxt
        return node, off

    def count(self, path: list[int]) -> int:
        """How many times `path` occurs in the sequences added (windows of at most max_depth)."""
        where = self.walk(path)
        return 0 if where is None else (where[0].count if path else 0)

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float, min_token_prob: float) -> Draft:
        """The best draft to follow `context`: for each length m of its suffix found in the tree,
        the most frequent continuation (at most min(max_tokens, max_spec_factor * m) tokens, the
        path at most max_depth long), cut where its estimated probability falls below
        min_token_prob; the draft with the highest score wins (a tie: the longer match)."""
        best = Draft([], [], 0)
        context = context[-self.max_depth :]
        for m in range(1, len(context) + 1):
            where = self.walk(context[len(context) - m :])
            if where is None:
                break  # a longer suffix contains this one: it cannot occur either
            limit = min(max_tokens, int(m * max_spec_factor + 1e-9), self.max_depth - m)
            draft = _follow(where[0], where[1], limit, min_token_prob, m)
            if draft.token_ids and draft.score >= best.score:
                best = draft
        return best


def _follow(node: Node, off: int, limit: int, min_token_prob: float, match_len: int) -> Draft:
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(tokens) < limit:
        if node.tail is not None:
            # One occurrence: its continuation, each token with conditional frequency 1/1
            seq, start, end = node.tail
            take = seq[start + off : min(end, start + off + limit - len(tokens))]
            tokens += take
            probs += [prob] * len(take)
            break
        if not node.children:
            break
        # The most frequent child (among equals the first added, so a draft is deterministic).
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        tokens.append(token)
        probs.append(prob)
        node = child
    return Draft(tokens, probs, match_len)


def _size(node: Node) -> int:
    stack, n = [node], 0
    while stack:
        x = stack.pop()
        n += 1
        if x.children:
            stack.extend(x.children.values())
    return n
