"""A recipe's YAML text as Python values, refusing a key given twice in one mapping.

PyYAML, as most YAML readers, keeps the last of two equal keys and drops the first without a word: a recipe with
two `optim:` sections, or a field written twice while editing, would train on half of what it says. Here the
second one stops the load with both lines named. Merge keys (`<<: *base`, then a key of the base given again to
override it) stay allowed: overriding a merged key is what they are for.
"""

from __future__ import annotations

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping (a YAMLError: callers that report bad YAML report this too)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise DuplicateKeyError(
                        f"`{key}` is given twice (lines {first_line[key]} and {line}); YAML would keep only the "
                        "second and drop the first without a word: merge the two into one")
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """`yaml.safe_load(text)`, but a key given twice in one mapping raises DuplicateKeyError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
