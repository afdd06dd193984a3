"""SFI's Selector: which tokens a request keeps in its compact buffer after a slow step."""

from sgl_sparse.selector.core import SelectorKnobs, refined_scores, select

__all__ = ["SelectorKnobs", "refined_scores", "select"]
