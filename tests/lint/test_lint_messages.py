"""Messages and fix lines in the code's own words: AG213 names the tensor it syncs (never a cut
expression), AG205 names the scaler and the dict, AG206 the spelling the code used."""

from __future__ import annotations

from ampguard.lint import lint_source

_LOOP = (
    "import torch\n"
    "scaler = torch.amp.GradScaler('cuda')\n"
    "def train(model, opt, loader, mloss):\n"
    "    for i, x in enumerate(loader):\n"
    "        out = model(x)\n"
    "        scaler.scale(out['loss']).backward()\n"
    "        scaler.step(opt)\n"
    "        scaler.update()\n"
    "        mloss = (mloss * i + out['loss'].detach()) / (i + 1)\n"
    "        {log}\n"
)


def _ag213(log: str) -> str:
    [finding] = [f for f in lint_source(_LOOP.format(log=log)) if f.code == "AG213"]
    return finding.message


def test_ag213_names_the_tensor_a_long_format_expression_reads() -> None:
    message = _ag213(
        "print(('%11s' * 2 + '%11.4g' * 5) % (f'{i}/{len(loader)}', 'x', *mloss, x.shape[0]))"
    )
    assert message.startswith("'%' formatting of mloss runs on every training step")
    assert "..." not in message.split(" runs ")[0]


def test_ag213_names_the_tensor_of_a_long_item_call() -> None:
    message = _ag213("print(model.criterion_outputs_for_logging(out)['loss'].mean().item())")
    assert message.startswith("loss.item() runs on every training step"), message


def test_ag205_and_ag206_fix_lines_use_the_code_s_names() -> None:
    source = (
        "import torch\n"
        "class S:\n"
        "    def __init__(self):\n"
        "        self.grad_scaler = torch.cuda.amp.GradScaler()\n"
        "    def save(self, path):\n"
        "        state = {'model': self.model.state_dict()}\n"
        "        state['optimizer'] = self.opt.state_dict()\n"
        "        torch.save(state, path)\n"
    )
    fixes = {f.code: f.fix for f in lint_source(source)}
    assert fixes["AG205"] == (
        "add state['scaler'] = self.grad_scaler.state_dict() before the save and call "
        "self.grad_scaler.load_state_dict(checkpoint['scaler']) when resuming"
    )
    assert fixes["AG206"].startswith("replace torch.cuda.amp.GradScaler(...) with ")
