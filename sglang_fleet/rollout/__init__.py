"""The operator verbs' decisions: the pre-flight's inputs, the restart, what every verb action
shares, and a driver branch changed host by host (docs/ARCHITECTURE.md, "Operator verbs").

Layers: docs/ARCHITECTURE.md, "Package map"."""
