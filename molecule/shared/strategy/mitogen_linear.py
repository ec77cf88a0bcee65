"""Ansible's linear strategy run through Mitogen, for the Molecule scenarios only.

Mitogen keeps one Python interpreter per test host for the whole run and sends it each module,
instead of starting a process in the container (runc) and a Python that re-imports Ansible's
module_utils for every task. Measured on a 2-core machine, 80 one-module tasks against one test
host over the docker connection: 27-30 s and 29-32 CPU-seconds with Ansible's own strategy,
4.3 s and 4.5 CPU-seconds with this one (docs/TESTING.md).

The strategy is the installed package's (requirements.txt pins it), as its own
plugins/strategy/mitogen_linear.py loads it, with two changes: the filter and test plugins are
loaded before the workers fork, and plays on the control node keep the plain linear strategy.
"""

import ansible_mitogen.loaders
import ansible_mitogen.strategy
from ansible.plugins.loader import filter_loader, test_loader

Base = ansible_mitogen.loaders.strategy_loader.get("linear", class_only=True)


class StrategyModule(ansible_mitogen.strategy.StrategyMixin, Base):
    """The linear strategy, with Mitogen's connections and module runner for the test hosts."""

    def run(self, iterator, play_context):
        # Load every filter and test plugin here, once, before the workers fork: each forked
        # worker would otherwise load them again for its first template that uses one.
        filter_loader.get("ansible.builtin.to_json")
        test_loader.get("ansible.builtin.match")
        # Molecule's own create and destroy plays (connection: local) poll their async jobs in a
        # directory of their choosing (ansible_async_dir) that Mitogen's async runner does not
        # write: plays on the control node keep Ansible's own linear strategy.
        if iterator._play.connection == "local":  # the play keyword (PlayContext says ssh here)
            return Base.run(self, iterator, play_context)
        return super().run(iterator, play_context)
