"""The one-shot step of a form that prunes a block's units (an MLP's channels, an attention block's key/value groups):
the units ranked once per site by the loss-weighted output energy of the projection that reads them, the site's
options offered to the knapsack (each kept count at its narrower products' cost and its exact error), and the chosen
count deployed from that ranking with the reading projection refitted. Written once here; ``channels`` and
``groups`` say only what differs: which projection ranks the units, how, and what a kept count builds."""

from __future__ import annotations

from bdlora.forms.context import BaseStep, Choice, OneShotContext


class PrunedBlockStep(BaseStep):
    """A form whose sites are blocks that keep fewer units. A subclass names ``ranked_by`` (the projection whose
    weight, input Gram and output Fisher order the units), ``ranking`` (the stage line) and implements ``order``,
    ``options`` and ``pruned``."""

    per_layer = True
    ranked_by: str
    ranking: str

    def prunes(self, ctx: OneShotContext) -> bool:
        """Whether this model's blocks have units to drop (an attention block with one key/value group has none)."""
        return True

    def order(self, ctx: OneShotContext, name: str, module):
        """The units of the site read by projection ``name`` (``module``), most important first."""
        raise NotImplementedError

    def options(self, ctx: OneShotContext, shapes: list, order) -> list[tuple[int, float, float]]:
        """(kept units, cost, error) of every option of a site whose projections are ``shapes``."""
        raise NotImplementedError

    def pruned(self, site: str, keep: int, mods: dict, order, gram) -> dict:
        """The site's projections keeping ``keep`` units, as deployed modules with their decisions."""
        raise NotImplementedError

    def offer(self, ctx: OneShotContext) -> None:
        if not self.prunes(ctx):
            return
        ctx.reporter.stage(self.ranking)
        for n, m in ctx.mods.items():
            if n.endswith(self.ranked_by):
                site = n.rsplit(".", 1)[0]
                order = ctx.own(self.name)[site] = self.order(ctx, n, m)
                shapes = [s for s in ctx.shapes if s.name.startswith(site + ".")]
                ctx.offer(site, [Choice(self.name, c, e, keep=k) for k, c, e in self.options(ctx, shapes, order)])

    def deploy(self, ctx: OneShotContext, alloc) -> dict:
        out = {}
        for site, choice in alloc.by(self.name).items():
            out.update(self.pruned(site, choice.keep, ctx.mods, ctx.own(self.name)[site],
                                   ctx.calib.gram(f"{site}.{self.ranked_by}")))
        return out
