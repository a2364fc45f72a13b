"""The sandbox: isolated runs of model-written code, graded where that code never ran; its hosts and fleet."""
