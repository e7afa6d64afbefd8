# ruff: noqa: E501  (the templates are real-code-shaped: 120-column lines, as YOLO repositories use)
"""A detection repository's shape, written for ``bench_lint.py``: a YOLO-style package of ~16k lines.

The tree is what ``ampguard lint`` meets in a real detection repository: ``models/`` (building
blocks, the detection head, experimental modules), ``utils/`` (general helpers, torch helpers,
losses, metrics, plots, datasets, augmentations, callbacks, loggers), and the scripts at the top
(``train.py`` with a GradScaler step, ``val.py``, ``detect.py``, ``export.py``), with the imports
between them that such a repository has (``from utils.general import LOGGER, check_file, ...``,
``from models.common import *``, ``import val as validate``). Every file is generated from
templates by :func:`write_tree` (deterministic: the same tree every time), so the benchmark does
not check in 16k lines; ``python benchmarks/yolo_tree.py DIR`` writes it to look at.
"""

from __future__ import annotations

import os
import sys
import textwrap

__all__ = ["MODULES", "write_tree"]

_HEADER = '''\
# YOLO-style detection code, generated for ampguard's lint benchmark
"""{doc}"""

import contextlib
import math
import os
import random
import time
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
'''

_GENERAL_FUNC = '''

def check_file_{i}(file, suffix="", verbose=True):
    """Search/download file {i} (if necessary) and return its path."""
    file = str(file)
    if os.path.isfile(file) or not file:
        return file
    elif file.startswith(("http:/", "https:/")):
        url = file
        file = Path(url).name.split("?")[0]
        if os.path.isfile(file):
            LOGGER.info(f"Found {{url}} locally at {{file}}")
        else:
            LOGGER.info(f"Downloading {{url}} to {{file}}...")
            assert Path(file).exists() and Path(file).stat().st_size > 0, f"File download failed: {{url}}"
        return file
    files = []
    for d in "data", "models", "utils":
        files.extend(sorted(Path(d).rglob(f"**/{{file}}")))
    assert len(files), f"File not found: {{file}}"
    assert len(files) == 1, f"Multiple files match '{{file}}', specify exact path: {{files}}"
    return files[0]


def increment_path_{i}(path, exist_ok=False, sep="", mkdir=False):
    """Increment path {i}: runs/exp --> runs/exp{{sep}}2, runs/exp{{sep}}3, ..."""
    path = Path(path)
    if path.exists() and not exist_ok:
        path, suffix = (path.with_suffix(""), path.suffix) if path.is_file() else (path, "")
        for n in range(2, 9999):
            p = f"{{path}}{{sep}}{{n}}{{suffix}}"
            if not os.path.exists(p):
                break
        path = Path(p)
    if mkdir:
        path.mkdir(parents=True, exist_ok=True)
    return path


def xywh2xyxy_{i}(x):
    """Convert nx4 boxes from [x, y, w, h] to [x1, y1, x2, y2] (set {i})."""
    y = x.clone() if isinstance(x, torch.Tensor) else np.copy(x)
    y[..., 0] = x[..., 0] - x[..., 2] / 2
    y[..., 1] = x[..., 1] - x[..., 3] / 2
    y[..., 2] = x[..., 0] + x[..., 2] / 2
    y[..., 3] = x[..., 1] + x[..., 3] / 2
    return y


def clip_boxes_{i}(boxes, shape):
    """Clip boxes (xyxy) to image shape (height, width), set {i}."""
    if isinstance(boxes, torch.Tensor):
        boxes[..., 0].clamp_(0, shape[1])
        boxes[..., 1].clamp_(0, shape[0])
        boxes[..., 2].clamp_(0, shape[1])
        boxes[..., 3].clamp_(0, shape[0])
    else:
        boxes[..., [0, 2]] = boxes[..., [0, 2]].clip(0, shape[1])
        boxes[..., [1, 3]] = boxes[..., [1, 3]].clip(0, shape[0])


def colorstr_{i}(*inputs):
    """Colour a string {i}: colorstr('blue', 'hello world')."""
    *args, string = inputs if len(inputs) > 1 else ("blue", "bold", inputs[0])
    colors = {{
        "black": "\\033[30m",
        "red": "\\033[31m",
        "green": "\\033[32m",
        "blue": "\\033[34m",
        "bold": "\\033[1m",
        "end": "\\033[0m",
    }}
    return "".join(colors[x] for x in args) + f"{{string}}" + colors["end"]
'''

_GENERAL_TAIL = '''

LOGGER = __import__("logging").getLogger("yolo")
RANK = int(os.getenv("RANK", -1))


def non_max_suppression(prediction, conf_thres=0.25, iou_thres=0.45, classes=None, max_det=300):
    """Non-Maximum Suppression on inference results: list of detections, (n, 6) per image."""
    bs = prediction.shape[0]
    nc = prediction.shape[2] - 5
    xc = prediction[..., 4] > conf_thres
    output = [torch.zeros((0, 6), device=prediction.device)] * bs
    for xi, x in enumerate(prediction):
        x = x[xc[xi]]
        if not x.shape[0]:
            continue
        x[:, 5:] *= x[:, 4:5]
        box = xywh2xyxy_0(x[:, :4])
        conf, j = x[:, 5:].max(1, keepdim=True)
        x = torch.cat((box, conf, j.float()), 1)[conf.view(-1) > conf_thres]
        if classes is not None:
            x = x[(x[:, 5:6] == torch.tensor(classes, device=x.device)).any(1)]
        n = x.shape[0]
        if not n:
            continue
        x = x[x[:, 4].argsort(descending=True)[:max_det]]
        output[xi] = x
    return output


def strip_optimizer(f="best.pt", s=""):
    """Strip optimizer from 'f' to finalize training, optionally save as 's'."""
    x = torch.load(f, map_location=torch.device("cpu"), weights_only=False)
    if x.get("ema"):
        x["model"] = x["ema"]
    for k in "optimizer", "best_fitness", "ema", "updates":
        x[k] = None
    x["epoch"] = -1
    x["model"].half()
    for p in x["model"].parameters():
        p.requires_grad = False
    torch.save(x, s or f)
    mb = os.path.getsize(s or f) / 1e6
    LOGGER.info(f"Optimizer stripped from {f},{f' saved as {s},' if s else ''} {mb:.1f}MB")
'''

_TORCH_UTILS = '''

@contextlib.contextmanager
def torch_distributed_zero_first(local_rank: int):
    """Make all processes wait for the local master to do something."""
    if local_rank not in [-1, 0]:
        torch.distributed.barrier(device_ids=[local_rank])
    yield
    if local_rank == 0:
        torch.distributed.barrier(device_ids=[0])


def de_parallel(model):
    """De-parallelize a model: returns a single-GPU model if model is of type DP or DDP."""
    return model.module if is_parallel(model) else model


def is_parallel(model):
    """Returns True if model is of type DP or DDP."""
    return type(model) in (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)


def smart_optimizer(model, name="Adam", lr=0.001, momentum=0.9, decay=1e-5):
    """YOLO 3-param group optimizer: 0) weights with decay, 1) weights no decay, 2) biases."""
    g = [], [], []
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=0):
            if p_name == "bias":
                g[2].append(p)
            elif p_name == "weight" and isinstance(v, bn):
                g[1].append(p)
            else:
                g[0].append(p)
    if name == "Adam":
        optimizer = torch.optim.Adam(g[2], lr=lr, betas=(momentum, 0.999))
    elif name == "AdamW":
        optimizer = torch.optim.AdamW(g[2], lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    return optimizer


class ModelEMA:
    """Updated Exponential Moving Average (EMA): keeps a moving average of the model state_dict."""

    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = de_parallel(model).state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()

    def update_attr(self, model, include=(), exclude=("process_group", "reducer")):
        copy_attr(self.ema, model, include, exclude)


def copy_attr(a, b, include=(), exclude=()):
    """Copy attributes from b to a, options to only include [...] and to exclude [...]."""
    for k, v in b.__dict__.items():
        if (len(include) and k not in include) or k.startswith("_") or k in exclude:
            continue
        setattr(a, k, v)


class EarlyStopping:
    """Simple early stopper."""

    def __init__(self, patience=30):
        self.best_fitness = 0.0
        self.best_epoch = 0
        self.patience = patience or float("inf")
        self.possible_stop = False

    def __call__(self, epoch, fitness):
        if fitness >= self.best_fitness:
            self.best_epoch = epoch
            self.best_fitness = fitness
        delta = epoch - self.best_epoch
        self.possible_stop = delta >= (self.patience - 1)
        stop = delta >= self.patience
        if stop:
            LOGGER.info(f"Stopping training early as no improvement observed in last {self.patience} epochs.")
        return stop
'''

_TORCH_UTILS_FUNC = '''

def time_sync_{i}():
    """PyTorch-accurate time (set {i})."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.time()


def fuse_conv_and_bn_{i}(conv, bn):
    """Fuse Conv2d() and BatchNorm2d() layers (set {i})."""
    fusedconv = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=True,
    ).requires_grad_(False).to(conv.weight.device)
    w_conv = conv.weight.clone().view(conv.out_channels, -1)
    w_bn = torch.diag(bn.weight.div(torch.sqrt(bn.eps + bn.running_var)))
    fusedconv.weight.copy_(torch.mm(w_bn, w_conv).view(fusedconv.weight.shape))
    b_conv = torch.zeros(conv.weight.size(0), device=conv.weight.device) if conv.bias is None else conv.bias
    b_bn = bn.bias - bn.weight.mul(bn.running_mean).div(torch.sqrt(bn.running_var + bn.eps))
    fusedconv.bias.copy_(torch.mm(w_bn, b_conv.reshape(-1, 1)).reshape(-1) + b_bn)
    return fusedconv


def model_info_{i}(model, verbose=False, imgsz=640):
    """Model information {i}: img_size may be int or list, i.e. img_size=640 or img_size=[640, 320]."""
    n_p = sum(x.numel() for x in model.parameters())
    n_g = sum(x.numel() for x in model.parameters() if x.requires_grad)
    if verbose:
        print(f"{{'layer':>5}} {{'name':>40}} {{'gradient':>9}} {{'parameters':>12}} {{'shape':>20}}")
        for i, (name, p) in enumerate(model.named_parameters()):
            name = name.replace("module_list.", "")
            print("%5g %40s %9s %12g %20s %10.3g %10.3g" % (i, name, p.requires_grad, p.numel(), list(p.shape), p.mean(), p.std()))
    name = Path(model.yaml_file).stem.replace("yolov5", "YOLOv5") if hasattr(model, "yaml_file") else "Model"
    LOGGER.info(f"{{name}} summary: {{len(list(model.modules()))}} layers, {{n_p}} parameters, {{n_g}} gradients")
'''

_COMMON_BLOCK = '''

class Conv{i}(nn.Module):
    """Standard convolution {i} with args(ch_in, ch_out, kernel, stride, padding, groups, dilation, activation)."""

    default_act = nn.SiLU()

    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, d=1, act=True):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p, d), groups=g, dilation=d, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = self.default_act if act is True else act if isinstance(act, nn.Module) else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))

    def forward_fuse(self, x):
        return self.act(self.conv(x))


class Bottleneck{i}(nn.Module):
    """Standard bottleneck {i}."""

    def __init__(self, c1, c2, shortcut=True, g=1, e=0.5):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv{i}(c1, c_, 1, 1)
        self.cv2 = Conv{i}(c_, c2, 3, 1, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class C3_{i}(nn.Module):
    """CSP Bottleneck with 3 convolutions (set {i})."""

    def __init__(self, c1, c2, n=1, shortcut=True, g=1, e=0.5):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv{i}(c1, c_, 1, 1)
        self.cv2 = Conv{i}(c1, c_, 1, 1)
        self.cv3 = Conv{i}(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck{i}(c_, c_, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x):
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF{i}(nn.Module):
    """Spatial Pyramid Pooling - Fast (SPPF) layer {i}."""

    def __init__(self, c1, c2, k=5):
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv{i}(c1, c_, 1, 1)
        self.cv2 = Conv{i}(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x):
        x = self.cv1(x)
        with contextlib.suppress(Warning):
            y1 = self.m(x)
            y2 = self.m(y1)
            return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Focus{i}(nn.Module):
    """Focus wh information into c-space (set {i})."""

    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, act=True):
        super().__init__()
        self.conv = Conv{i}(c1 * 4, c2, k, s, p, g, act=act)

    def forward(self, x):
        return self.conv(torch.cat((x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2]), 1))
'''

_COMMON_TAIL = '''

def autopad(k, p=None, d=1):
    """Pad to 'same' shape outputs."""
    if d > 1:
        k = d * (k - 1) + 1 if isinstance(k, int) else [d * (x - 1) + 1 for x in k]
    if p is None:
        p = k // 2 if isinstance(k, int) else [x // 2 for x in k]
    return p


class Concat(nn.Module):
    """Concatenate a list of tensors along dimension."""

    def __init__(self, dimension=1):
        super().__init__()
        self.d = dimension

    def forward(self, x):
        return torch.cat(x, self.d)


class AutoShape(nn.Module):
    """Input-robust model wrapper for passing cv2/np/PIL/torch inputs; includes pre-processing,
    inference and NMS."""

    conf = 0.25
    iou = 0.45

    def __init__(self, model, verbose=True):
        super().__init__()
        self.model = model.eval()
        self.pt = True

    @smart_inference_mode()
    def forward(self, ims, size=640, augment=False, profile=False):
        autocast = self.amp and (p.device.type != "cpu")
        p = next(self.model.parameters()) if self.pt else torch.empty(1)
        if isinstance(ims, torch.Tensor):
            with amp.autocast(autocast):
                return self.model(ims.to(p.device).type_as(p), augment=augment)
        n, ims = (len(ims), list(ims)) if isinstance(ims, (list, tuple)) else (1, [ims])
        with amp.autocast(autocast):
            y = self.model(torch.stack(ims), augment=augment)
            y = non_max_suppression(y, self.conf, self.iou, max_det=self.max_det)
        return y
'''

_YOLO = '''
from models.common import *
from models.experimental import *
from utils.general import LOGGER, check_file_0, colorstr_0, increment_path_0
from utils.torch_utils import de_parallel, fuse_conv_and_bn_0, model_info_0, time_sync_0


class Detect(nn.Module):
    """YOLO Detect head for detection models."""

    stride = None
    dynamic = False
    export = False

    def __init__(self, nc=80, anchors=(), ch=(), inplace=True):
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        self.grid = [torch.empty(0) for _ in range(self.nl)]
        self.anchor_grid = [torch.empty(0) for _ in range(self.nl)]
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(x, self.no * self.na, 1) for x in ch)
        self.inplace = inplace

    def forward(self, x):
        z = []
        for i in range(self.nl):
            x[i] = self.m[i](x[i])
            bs, _, ny, nx = x[i].shape
            x[i] = x[i].view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            if not self.training:
                if self.dynamic or self.grid[i].shape[2:4] != x[i].shape[2:4]:
                    self.grid[i], self.anchor_grid[i] = self._make_grid(nx, ny, i)
                xy, wh, conf = x[i].sigmoid().split((2, 2, self.nc + 1), 4)
                xy = (xy * 2 + self.grid[i]) * self.stride[i]
                wh = (wh * 2) ** 2 * self.anchor_grid[i]
                y = torch.cat((xy, wh, conf), 4)
                z.append(y.view(bs, self.na * nx * ny, self.no))
        return x if self.training else (torch.cat(z, 1),) if self.export else (torch.cat(z, 1), x)

    def _make_grid(self, nx=20, ny=20, i=0):
        d = self.anchors[i].device
        t = self.anchors[i].dtype
        shape = 1, self.na, ny, nx, 2
        y, x = torch.arange(ny, device=d, dtype=t), torch.arange(nx, device=d, dtype=t)
        yv, xv = torch.meshgrid(y, x, indexing="ij")
        grid = torch.stack((xv, yv), 2).expand(shape) - 0.5
        anchor_grid = (self.anchors[i] * self.stride[i]).view((1, self.na, 1, 1, 2)).expand(shape)
        return grid, anchor_grid


class BaseModel(nn.Module):
    """YOLO base model."""

    def forward(self, x, profile=False, visualize=False):
        return self._forward_once(x, profile, visualize)

    def _forward_once(self, x, profile=False, visualize=False):
        y, dt = [], []
        for m in self.model:
            if m.f != -1:
                x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
            if profile:
                self._profile_one_layer(m, x, dt)
            x = m(x)
            y.append(x if m.i in self.save else None)
        return x

    def _profile_one_layer(self, m, x, dt):
        c = m == self.model[-1]
        t = time_sync_0()
        for _ in range(10):
            m(x.copy() if c else x)
        dt.append((time_sync_0() - t) * 100)
        if m == self.model[0]:
            LOGGER.info(f"{'time (ms)':>10s} {'GFLOPs':>10s} {'params':>10s}  module")
        LOGGER.info(f"{dt[-1]:10.2f} {m.np:10.0f}  {m.type}")

    def fuse(self):
        LOGGER.info("Fusing layers... ")
        for m in self.model.modules():
            if isinstance(m, (Conv0, Conv1)) and hasattr(m, "bn"):
                m.conv = fuse_conv_and_bn_0(m.conv, m.bn)
                delattr(m, "bn")
                m.forward = m.forward_fuse
        self.info()
        return self

    def info(self, verbose=False, img_size=640):
        model_info_0(self, verbose, img_size)


class DetectionModel(BaseModel):
    """YOLO detection model."""

    def __init__(self, cfg="yolov5s.yaml", ch=3, nc=None, anchors=None):
        super().__init__()
        self.yaml_file = Path(cfg).name
        self.yaml = {"nc": nc or 80, "anchors": anchors}
        self.model, self.save = parse_model(deepcopy(self.yaml), ch=[ch])
        self.names = [str(i) for i in range(self.yaml["nc"])]
        self.inplace = self.yaml.get("inplace", True)
        m = self.model[-1]
        if isinstance(m, Detect):
            s = 256
            m.inplace = self.inplace
            m.stride = torch.tensor([s / x.shape[-2] for x in self.forward(torch.zeros(1, ch, s, s))])
            self.stride = m.stride
            self._initialize_biases()
        self.info()
        LOGGER.info("")

    def _initialize_biases(self, cf=None):
        m = self.model[-1]
        for mi, s in zip(m.m, m.stride):
            b = mi.bias.view(m.na, -1)
            b.data[:, 4] += math.log(8 / (640 / s) ** 2)
            b.data[:, 5 : 5 + m.nc] += math.log(0.6 / (m.nc - 0.99)) if cf is None else torch.log(cf / cf.sum())
            mi.bias = torch.nn.Parameter(b.view(-1), requires_grad=True)


Model = DetectionModel


def parse_model(d, ch):
    """Parse a YOLO model.yaml dictionary."""
    LOGGER.info(f"{'':>3}{'from':>18}{'n':>3}{'params':>10}  {'module':<40}{'arguments':<30}")
    anchors, nc, gd, gw = d["anchors"], d["nc"], d.get("depth_multiple", 1.0), d.get("width_multiple", 1.0)
    na = (len(anchors[0]) // 2) if isinstance(anchors, list) else anchors
    no = na * (nc + 5)
    layers, save, c2 = [], [], ch[-1]
    for i, (f, n, m, args) in enumerate(d.get("backbone", []) + d.get("head", [])):
        m = eval(m) if isinstance(m, str) else m
        for j, a in enumerate(args):
            with contextlib.suppress(NameError):
                args[j] = eval(a) if isinstance(a, str) else a
        n = n_ = max(round(n * gd), 1) if n > 1 else n
        if m in {Conv0, Bottleneck0, SPPF0, Focus0, C3_0}:
            c1, c2 = ch[f], args[0]
            if c2 != no:
                c2 = math.ceil(c2 * gw / 8) * 8
            args = [c1, c2, *args[1:]]
            if m in {C3_0}:
                args.insert(2, n)
                n = 1
        elif m is nn.BatchNorm2d:
            args = [ch[f]]
        elif m is Concat:
            c2 = sum(ch[x] for x in f)
        elif m is Detect:
            args.append([ch[x] for x in f])
        else:
            c2 = ch[f]
        m_ = nn.Sequential(*(m(*args) for _ in range(n))) if n > 1 else m(*args)
        t = str(m)[8:-2].replace("__main__.", "")
        np_ = sum(x.numel() for x in m_.parameters())
        m_.i, m_.f, m_.type, m_.np = i, f, t, np_
        LOGGER.info(f"{i:>3}{str(f):>18}{n_:>3}{np_:10.0f}  {t:<40}{str(args):<30}")
        save.extend(x % i for x in ([f] if isinstance(f, int) else f) if x != -1)
        layers.append(m_)
        if i == 0:
            ch = []
        ch.append(c2)
    return nn.Sequential(*layers), sorted(save)
'''

_EXPERIMENTAL = '''
from models.common import Conv0, Conv1, autopad
from utils.general import LOGGER


class Sum(nn.Module):
    """Weighted sum of 2 or more layers."""

    def __init__(self, n, weight=False):
        super().__init__()
        self.weight = weight
        self.iter = range(n - 1)
        if weight:
            self.w = nn.Parameter(-torch.arange(1.0, n) / 2, requires_grad=True)

    def forward(self, x):
        y = x[0]
        if self.weight:
            w = torch.sigmoid(self.w) * 2
            for i in self.iter:
                y = y + x[i + 1] * w[i]
        else:
            for i in self.iter:
                y = y + x[i + 1]
        return y


class MixConv2d(nn.Module):
    """Mixed Depth-wise Conv https://arxiv.org/abs/1907.09595."""

    def __init__(self, c1, c2, k=(1, 3), s=1, equal_ch=True):
        super().__init__()
        n = len(k)
        if equal_ch:
            i = torch.linspace(0, n - 1e-6, c2).floor()
            c_ = [(i == g).sum() for g in range(n)]
        else:
            b = [c2] + [0] * n
            a = np.eye(n + 1, n, k=-1)
            a -= np.roll(a, 1, axis=1)
            a *= np.array(k) ** 2
            a[0] = 1
            c_ = np.linalg.lstsq(a, b, rcond=None)[0].round()
        self.m = nn.ModuleList([nn.Conv2d(c1, int(c_), k, s, k // 2, groups=math.gcd(c1, int(c_)), bias=False) for k, c_ in zip(k, c_)])
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(torch.cat([m(x) for m in self.m], 1)))


class Ensemble(nn.ModuleList):
    """Ensemble of models."""

    def forward(self, x, augment=False, profile=False, visualize=False):
        y = [module(x, augment, profile, visualize)[0] for module in self]
        y = torch.cat(y, 1)
        return y, None


def attempt_load(weights, device=None, inplace=True, fuse=True):
    """Loads an ensemble of models weights=[a,b,c] or a single model weights=[a] or weights=a."""
    model = Ensemble()
    for w in weights if isinstance(weights, list) else [weights]:
        ckpt = torch.load(w, map_location="cpu", weights_only=False)
        ckpt = (ckpt.get("ema") or ckpt["model"]).to(device).float()
        if not hasattr(ckpt, "stride"):
            ckpt.stride = torch.tensor([32.0])
        model.append(ckpt.fuse().eval() if fuse and hasattr(ckpt, "fuse") else ckpt.eval())
    for m in model.modules():
        t = type(m)
        if t in (nn.Hardswish, nn.LeakyReLU, nn.ReLU, nn.ReLU6, nn.SiLU):
            m.inplace = inplace
    if len(model) == 1:
        return model[-1]
    LOGGER.info(f"Ensemble created with {weights}\\n")
    return model
'''

_EXPERIMENTAL_BLOCK = '''

class CrossConv{i}(nn.Module):
    """Cross Convolution Downsample (set {i})."""

    def __init__(self, c1, c2, k=3, s=1, g=1, e=1.0, shortcut=False):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv0(c1, c_, (1, k), (1, s))
        self.cv2 = Conv1(c_, c2, (k, 1), (s, 1), g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class GhostConv{i}(nn.Module):
    """Ghost Convolution https://github.com/huawei-noah/ghostnet (set {i})."""

    def __init__(self, c1, c2, k=1, s=1, g=1, act=True):
        super().__init__()
        c_ = c2 // 2
        self.cv1 = Conv0(c1, c_, k, s, None, g, act=act)
        self.cv2 = Conv0(c_, c_, 5, 1, None, c_, act=act)

    def forward(self, x):
        y = self.cv1(x)
        return torch.cat((y, self.cv2(y)), 1)
'''

_LOSS = '''
from utils.general import LOGGER
from utils.metrics import bbox_iou_0
from utils.torch_utils import de_parallel


def smooth_BCE(eps=0.1):
    """Return positive, negative label smoothing BCE targets."""
    return 1.0 - 0.5 * eps, 0.5 * eps


class FocalLoss(nn.Module):
    """Wraps focal loss around existing loss_fcn(), i.e. criteria = FocalLoss(nn.BCEWithLogitsLoss(), gamma=1.5)."""

    def __init__(self, loss_fcn, gamma=1.5, alpha=0.25):
        super().__init__()
        self.loss_fcn = loss_fcn
        self.gamma = gamma
        self.alpha = alpha
        self.reduction = loss_fcn.reduction
        self.loss_fcn.reduction = "none"

    def forward(self, pred, true):
        loss = self.loss_fcn(pred, true)
        pred_prob = torch.sigmoid(pred)
        p_t = true * pred_prob + (1 - true) * (1 - pred_prob)
        alpha_factor = true * self.alpha + (1 - true) * (1 - self.alpha)
        modulating_factor = (1.0 - p_t) ** self.gamma
        loss *= alpha_factor * modulating_factor
        if self.reduction == "mean":
            return loss.mean()
        elif self.reduction == "sum":
            return loss.sum()
        return loss


class ComputeLoss:
    """Compute losses."""

    sort_obj_iou = False

    def __init__(self, model, autobalance=False):
        device = next(model.parameters()).device
        h = model.hyp
        BCEcls = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["cls_pw"]], device=device))
        BCEobj = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["obj_pw"]], device=device))
        self.cp, self.cn = smooth_BCE(eps=h.get("label_smoothing", 0.0))
        g = h["fl_gamma"]
        if g > 0:
            BCEcls, BCEobj = FocalLoss(BCEcls, g), FocalLoss(BCEobj, g)
        m = de_parallel(model).model[-1]
        self.balance = {3: [4.0, 1.0, 0.4]}.get(m.nl, [4.0, 1.0, 0.25, 0.06, 0.02])
        self.ssi = list(m.stride).index(16) if autobalance else 0
        self.BCEcls, self.BCEobj, self.gr, self.hyp, self.autobalance = BCEcls, BCEobj, 1.0, h, autobalance
        self.na = m.na
        self.nc = m.nc
        self.nl = m.nl
        self.anchors = m.anchors
        self.device = device

    def __call__(self, p, targets):
        lcls = torch.zeros(1, device=self.device)
        lbox = torch.zeros(1, device=self.device)
        lobj = torch.zeros(1, device=self.device)
        tcls, tbox, indices, anchors = self.build_targets(p, targets)
        for i, pi in enumerate(p):
            b, a, gj, gi = indices[i]
            tobj = torch.zeros(pi.shape[:4], dtype=pi.dtype, device=self.device)
            n = b.shape[0]
            if n:
                pxy, pwh, _, pcls = pi[b, a, gj, gi].split((2, 2, 1, self.nc), 1)
                pxy = pxy.sigmoid() * 2 - 0.5
                pwh = (pwh.sigmoid() * 2) ** 2 * anchors[i]
                pbox = torch.cat((pxy, pwh), 1)
                iou = bbox_iou_0(pbox, tbox[i], CIoU=True).squeeze()
                lbox += (1.0 - iou).mean()
                iou = iou.detach().clamp(0).type(tobj.dtype)
                if self.sort_obj_iou:
                    j = iou.argsort()
                    b, a, gj, gi, iou = b[j], a[j], gj[j], gi[j], iou[j]
                if self.gr < 1:
                    iou = (1.0 - self.gr) + self.gr * iou
                tobj[b, a, gj, gi] = iou
                if self.nc > 1:
                    t = torch.full_like(pcls, self.cn, device=self.device)
                    t[range(n), tcls[i]] = self.cp
                    lcls += self.BCEcls(pcls, t)
            obji = self.BCEobj(pi[..., 4], tobj)
            lobj += obji * self.balance[i]
            if self.autobalance:
                self.balance[i] = self.balance[i] * 0.9999 + 0.0001 / obji.detach().item()
        if self.autobalance:
            self.balance = [x / self.balance[self.ssi] for x in self.balance]
        lbox *= self.hyp["box"]
        lobj *= self.hyp["obj"]
        lcls *= self.hyp["cls"]
        bs = tobj.shape[0]
        return (lbox + lobj + lcls) * bs, torch.cat((lbox, lobj, lcls)).detach()

    def build_targets(self, p, targets):
        na, nt = self.na, targets.shape[0]
        tcls, tbox, indices, anch = [], [], [], []
        gain = torch.ones(7, device=self.device)
        ai = torch.arange(na, device=self.device).float().view(na, 1).repeat(1, nt)
        targets = torch.cat((targets.repeat(na, 1, 1), ai[..., None]), 2)
        g = 0.5
        off = torch.tensor([[0, 0], [1, 0], [0, 1], [-1, 0], [0, -1]], device=self.device).float() * g
        for i in range(self.nl):
            anchors, shape = self.anchors[i], p[i].shape
            gain[2:6] = torch.tensor(shape)[[3, 2, 3, 2]]
            t = targets * gain
            if nt:
                r = t[..., 4:6] / anchors[:, None]
                j = torch.max(r, 1 / r).max(2)[0] < self.hyp["anchor_t"]
                t = t[j]
                gxy = t[:, 2:4]
                gxi = gain[[2, 3]] - gxy
                j, k = ((gxy % 1 < g) & (gxy > 1)).T
                l, m = ((gxi % 1 < g) & (gxi > 1)).T
                j = torch.stack((torch.ones_like(j), j, k, l, m))
                t = t.repeat((5, 1, 1))[j]
                offsets = (torch.zeros_like(gxy)[None] + off[:, None])[j]
            else:
                t = targets[0]
                offsets = 0
            bc, gxy, gwh, a = t.chunk(4, 1)
            a, (b, c) = a.long().view(-1), bc.long().T
            gij = (gxy - offsets).long()
            gi, gj = gij.T
            indices.append((b, a, gj.clamp_(0, shape[2] - 1), gi.clamp_(0, shape[3] - 1)))
            tbox.append(torch.cat((gxy - gij, gwh), 1))
            anch.append(anchors[a])
            tcls.append(c)
        return tcls, tbox, indices, anch
'''

_METRICS_FUNC = '''

def bbox_iou_{i}(box1, box2, xywh=True, GIoU=False, DIoU=False, CIoU=False, eps=1e-7):
    """IoU of box1(1,4) to box2(n,4) (set {i})."""
    if xywh:
        (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.chunk(4, -1), box2.chunk(4, -1)
        w1_, h1_, w2_, h2_ = w1 / 2, h1 / 2, w2 / 2, h2 / 2
        b1_x1, b1_x2, b1_y1, b1_y2 = x1 - w1_, x1 + w1_, y1 - h1_, y1 + h1_
        b2_x1, b2_x2, b2_y1, b2_y2 = x2 - w2_, x2 + w2_, y2 - h2_, y2 + h2_
    else:
        b1_x1, b1_y1, b1_x2, b1_y2 = box1.chunk(4, -1)
        b2_x1, b2_y1, b2_x2, b2_y2 = box2.chunk(4, -1)
        w1, h1 = b1_x2 - b1_x1, (b1_y2 - b1_y1).clamp(eps)
        w2, h2 = b2_x2 - b2_x1, (b2_y2 - b2_y1).clamp(eps)
    inter = (b1_x2.minimum(b2_x2) - b1_x1.maximum(b2_x1)).clamp(0) * (
        b1_y2.minimum(b2_y2) - b1_y1.maximum(b2_y1)
    ).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if CIoU or DIoU or GIoU:
        cw = b1_x2.maximum(b2_x2) - b1_x1.minimum(b2_x1)
        ch = b1_y2.maximum(b2_y2) - b1_y1.minimum(b2_y1)
        if CIoU or DIoU:
            c2 = cw**2 + ch**2 + eps
            rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2) ** 2 + (b2_y1 + b2_y2 - b1_y1 - b1_y2) ** 2) / 4
            if CIoU:
                v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)).pow(2)
                with torch.no_grad():
                    alpha = v / (v - iou + (1 + eps))
                return iou - (rho2 / c2 + v * alpha)
            return iou - rho2 / c2
        c_area = cw * ch + eps
        return iou - (c_area - union) / c_area
    return iou


def ap_per_class_{i}(tp, conf, pred_cls, target_cls, plot=False, save_dir=".", names=(), eps=1e-16):
    """Compute the average precision, given the recall and precision curves (set {i})."""
    i = np.argsort(-conf)
    tp, conf, pred_cls = tp[i], conf[i], pred_cls[i]
    unique_classes, nt = np.unique(target_cls, return_counts=True)
    nc = unique_classes.shape[0]
    px, py = np.linspace(0, 1, 1000), []
    ap, p, r = np.zeros((nc, tp.shape[1])), np.zeros((nc, 1000)), np.zeros((nc, 1000))
    for ci, c in enumerate(unique_classes):
        i = pred_cls == c
        n_l = nt[ci]
        n_p = i.sum()
        if n_p == 0 or n_l == 0:
            continue
        fpc = (1 - tp[i]).cumsum(0)
        tpc = tp[i].cumsum(0)
        recall = tpc / (n_l + eps)
        r[ci] = np.interp(-px, -conf[i], recall[:, 0], left=0)
        precision = tpc / (tpc + fpc)
        p[ci] = np.interp(-px, -conf[i], precision[:, 0], left=1)
        for j in range(tp.shape[1]):
            ap[ci, j], mpre, mrec = compute_ap_{i}(recall[:, j], precision[:, j])
    f1 = 2 * p * r / (p + r + eps)
    i = smooth_{i}(f1.mean(0), 0.1).argmax()
    p, r, f1 = p[:, i], r[:, i], f1[:, i]
    tp = (r * nt).round()
    fp = (tp / (p + eps) - tp).round()
    return tp, fp, p, r, f1, ap, unique_classes.astype(int)


def compute_ap_{i}(recall, precision):
    """Compute the average precision, given the recall and precision curves (set {i})."""
    mrec = np.concatenate(([0.0], recall, [1.0]))
    mpre = np.concatenate(([1.0], precision, [0.0]))
    mpre = np.flip(np.maximum.accumulate(np.flip(mpre)))
    method = "interp"
    if method == "interp":
        x = np.linspace(0, 1, 101)
        ap = np.trapz(np.interp(x, mrec, mpre), x)
    else:
        i = np.where(mrec[1:] != mrec[:-1])[0]
        ap = np.sum((mrec[i + 1] - mrec[i]) * mpre[i + 1])
    return ap, mpre, mrec


def smooth_{i}(y, f=0.05):
    """Box filter of fraction f (set {i})."""
    nf = round(len(y) * f * 2) // 2 + 1
    p = np.ones(nf // 2)
    yp = np.concatenate((p * y[0], y, p * y[-1]), 0)
    return np.convolve(yp, np.ones(nf) / nf, mode="valid")


def fitness_{i}(x):
    """Model fitness as a weighted combination of metrics (set {i})."""
    w = [0.0, 0.0, 0.1, 0.9]
    return (x[:, :4] * w).sum(1)
'''

_PLOTS_FUNC = '''

class Colors{i}:
    """Ultralytics color palette (set {i})."""

    def __init__(self):
        hexs = ("FF3838", "FF9D97", "FF701F", "FFB21D", "CFD231", "48F90A", "92CC17", "3DDB86")
        self.palette = [self.hex2rgb(f"#{{c}}") for c in hexs]
        self.n = len(self.palette)

    def __call__(self, i, bgr=False):
        c = self.palette[int(i) % self.n]
        return (c[2], c[1], c[0]) if bgr else c

    @staticmethod
    def hex2rgb(h):
        return tuple(int(h[1 + i : 1 + i + 2], 16) for i in (0, 2, 4))


def output_to_target_{i}(output, max_det=300):
    """Convert model output to target format [batch_id, class_id, x, y, w, h, conf] (set {i})."""
    targets = []
    for i, o in enumerate(output):
        box, conf, cls = o[:max_det, :6].cpu().split((4, 1, 1), 1)
        j = torch.full((conf.shape[0], 1), i)
        targets.append(torch.cat((j, cls, xyxy2xywh_{i}(box), conf), 1))
    return torch.cat(targets, 0).numpy()


def xyxy2xywh_{i}(x):
    """Convert nx4 boxes from [x1, y1, x2, y2] to [x, y, w, h] (set {i})."""
    y = x.clone() if isinstance(x, torch.Tensor) else np.copy(x)
    y[..., 0] = (x[..., 0] + x[..., 2]) / 2
    y[..., 1] = (x[..., 1] + x[..., 3]) / 2
    y[..., 2] = x[..., 2] - x[..., 0]
    y[..., 3] = x[..., 3] - x[..., 1]
    return y


def plot_images_{i}(images, targets, paths=None, fname="images.jpg", names=None):
    """Plot an image grid with labels (set {i})."""
    if isinstance(images, torch.Tensor):
        images = images.cpu().float().numpy()
    if isinstance(targets, torch.Tensor):
        targets = targets.cpu().numpy()
    max_size = 1920
    max_subplots = 16
    bs, _, h, w = images.shape
    bs = min(bs, max_subplots)
    ns = np.ceil(bs**0.5)
    if np.max(images[0]) <= 1:
        images *= 255
    mosaic = np.full((int(ns * h), int(ns * w), 3), 255, dtype=np.uint8)
    for i, im in enumerate(images):
        if i == max_subplots:
            break
        x, y = int(w * (i // ns)), int(h * (i % ns))
        im = im.transpose(1, 2, 0)
        mosaic[y : y + h, x : x + w, :] = im
    scale = max_size / ns / max(h, w)
    if scale < 1:
        h = math.ceil(scale * h)
        w = math.ceil(scale * w)
    for i in range(i + 1):
        x, y = int(w * (i // ns)), int(h * (i % ns))
        if paths:
            LOGGER.info(text=Path(paths[i]).name[:40])
        if len(targets) > 0:
            ti = targets[targets[:, 0] == i]
            boxes = xyxy2xywh_{i}(ti[:, 2:6]).T
            classes = ti[:, 1].astype("int")
            labels = ti.shape[1] == 6
            conf = None if labels else ti[:, 6]
            for j, box in enumerate(boxes.T.tolist()):
                cls = classes[j]
                cls = names[cls] if names else cls
                if labels or conf[j] > 0.25:
                    label = f"{{cls}}" if labels else f"{{cls}} {{conf[j]:.1f}}"
    return mosaic
'''

_DATASETS_FUNC = '''

class LoadImagesAndLabels{i}(torch.utils.data.Dataset):
    """YOLO train_loader/val_loader, loads images and labels for training and validation (set {i})."""

    cache_version = 0.6

    def __init__(self, path, img_size=640, batch_size=16, augment=False, hyp=None, rect=False, stride=32, pad=0.0, prefix=""):
        self.img_size = img_size
        self.augment = augment
        self.hyp = hyp
        self.rect = rect
        self.mosaic = self.augment and not self.rect
        self.mosaic_border = [-img_size // 2, -img_size // 2]
        self.stride = stride
        self.path = path
        try:
            f = []
            for p in path if isinstance(path, list) else [path]:
                p = Path(p)
                if p.is_dir():
                    f += sorted(str(x) for x in p.rglob("*.*"))
                elif p.is_file():
                    with open(p) as t:
                        t = t.read().strip().splitlines()
                        parent = str(p.parent) + os.sep
                        f += [x.replace("./", parent, 1) if x.startswith("./") else x for x in t]
                else:
                    raise FileNotFoundError(f"{{prefix}}{{p}} does not exist")
            self.im_files = sorted(x.replace("/", os.sep) for x in f if x.split(".")[-1].lower() in ("jpg", "png"))
            assert self.im_files, f"{{prefix}}No images found"
        except Exception as e:
            raise Exception(f"{{prefix}}Error loading data from {{path}}: {{e}}") from e
        self.label_files = [x.rsplit(".", 1)[0] + ".txt" for x in self.im_files]
        n = len(self.im_files)
        bi = np.floor(np.arange(n) / batch_size).astype(int)
        self.batch = bi
        self.n = n
        self.indices = range(n)

    def __len__(self):
        return len(self.im_files)

    def __getitem__(self, index):
        index = self.indices[index]
        hyp = self.hyp
        mosaic = self.mosaic and random.random() < hyp["mosaic"]
        if mosaic:
            img, labels = self.load_mosaic(index)
            shapes = None
        else:
            img, (h0, w0), (h, w) = self.load_image(index)
            shape = self.img_size
            labels = self.labels[index].copy()
            shapes = (h0, w0), ((h / h0, w / w0), (0, 0))
        nl = len(labels)
        labels_out = torch.zeros((nl, 6))
        if nl:
            labels_out[:, 1:] = torch.from_numpy(labels)
        img = img.transpose((2, 0, 1))[::-1]
        img = np.ascontiguousarray(img)
        return torch.from_numpy(img), labels_out, self.im_files[index], shapes

    def load_image(self, i):
        im, f = None, self.im_files[i]
        h0, w0 = 640, 640
        r = self.img_size / max(h0, w0)
        return im, (h0, w0), (int(h0 * r), int(w0 * r))

    def load_mosaic(self, index):
        labels4 = []
        s = self.img_size
        yc, xc = (int(random.uniform(-x, 2 * s + x)) for x in self.mosaic_border)
        indices = [index] + random.choices(self.indices, k=3)
        random.shuffle(indices)
        for i, index in enumerate(indices):
            img, _, (h, w) = self.load_image(index)
            labels = self.labels[index].copy()
            labels4.append(labels)
        labels4 = np.concatenate(labels4, 0)
        return img, labels4

    @staticmethod
    def collate_fn(batch):
        im, label, path, shapes = zip(*batch)
        for i, lb in enumerate(label):
            lb[:, 0] = i
        return torch.stack(im, 0), torch.cat(label, 0), path, shapes


def create_dataloader_{i}(path, imgsz, batch_size, stride, hyp=None, augment=False, rank=-1, workers=8, shuffle=False, prefix=""):
    """Create a dataloader (set {i})."""
    with torch_distributed_zero_first(rank):
        dataset = LoadImagesAndLabels{i}(path, imgsz, batch_size, augment=augment, hyp=hyp, stride=int(stride), prefix=prefix)
    batch_size = min(batch_size, len(dataset))
    nd = torch.cuda.device_count()
    nw = min([os.cpu_count() // max(nd, 1), batch_size if batch_size > 1 else 0, workers])
    sampler = None if rank == -1 else torch.utils.data.distributed.DistributedSampler(dataset, shuffle=shuffle)
    loader = torch.utils.data.DataLoader
    generator = torch.Generator()
    generator.manual_seed(6148914691236517205 + RANK)
    return loader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle and sampler is None,
        num_workers=nw,
        sampler=sampler,
        pin_memory=True,
        collate_fn=LoadImagesAndLabels{i}.collate_fn,
        generator=generator,
    ), dataset
'''

_AUGMENT_FUNC = '''

def augment_hsv_{i}(im, hgain=0.5, sgain=0.5, vgain=0.5):
    """HSV color-space augmentation (set {i})."""
    if hgain or sgain or vgain:
        r = np.random.uniform(-1, 1, 3) * [hgain, sgain, vgain] + 1
        dtype = im.dtype
        x = np.arange(0, 256, dtype=r.dtype)
        lut_hue = ((x * r[0]) % 180).astype(dtype)
        lut_sat = np.clip(x * r[1], 0, 255).astype(dtype)
        lut_val = np.clip(x * r[2], 0, 255).astype(dtype)
        return lut_hue, lut_sat, lut_val
    return None


def letterbox_{i}(im, new_shape=(640, 640), color=(114, 114, 114), auto=True, scaleFill=False, scaleup=True, stride=32):
    """Resize and pad image while meeting stride-multiple constraints (set {i})."""
    shape = im.shape[:2]
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    r = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    if not scaleup:
        r = min(r, 1.0)
    ratio = r, r
    new_unpad = int(round(shape[1] * r)), int(round(shape[0] * r))
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = np.mod(dw, stride), np.mod(dh, stride)
    elif scaleFill:
        dw, dh = 0.0, 0.0
        new_unpad = (new_shape[1], new_shape[0])
        ratio = new_shape[1] / shape[1], new_shape[0] / shape[0]
    dw /= 2
    dh /= 2
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    return im, ratio, (dw, dh)


def random_perspective_{i}(im, targets=(), degrees=10, translate=0.1, scale=0.1, shear=10, perspective=0.0, border=(0, 0)):
    """Random perspective augmentation (set {i})."""
    height = im.shape[0] + border[0] * 2
    width = im.shape[1] + border[1] * 2
    C = np.eye(3)
    C[0, 2] = -im.shape[1] / 2
    C[1, 2] = -im.shape[0] / 2
    P = np.eye(3)
    P[2, 0] = random.uniform(-perspective, perspective)
    P[2, 1] = random.uniform(-perspective, perspective)
    R = np.eye(3)
    a = random.uniform(-degrees, degrees)
    s = random.uniform(1 - scale, 1 + scale)
    S = np.eye(3)
    S[0, 1] = math.tan(random.uniform(-shear, shear) * math.pi / 180)
    S[1, 0] = math.tan(random.uniform(-shear, shear) * math.pi / 180)
    T = np.eye(3)
    T[0, 2] = random.uniform(0.5 - translate, 0.5 + translate) * width
    T[1, 2] = random.uniform(0.5 - translate, 0.5 + translate) * height
    M = T @ S @ R @ P @ C
    n = len(targets)
    if n:
        new = np.zeros((n, 4))
        xy = np.ones((n * 4, 3))
        xy[:, :2] = targets[:, [1, 2, 3, 4, 1, 4, 3, 2]].reshape(n * 4, 2)
        xy = xy @ M.T
        xy = xy[:, :2] / xy[:, 2:3] if perspective else xy[:, :2]
        x = xy[:, [0, 2, 4, 6]]
        y = xy[:, [1, 3, 5, 7]]
        new = np.concatenate((x.min(1), y.min(1), x.max(1), y.max(1))).reshape(4, n).T
        targets[:, 1:5] = new
    return im, targets
'''

_CALLBACKS = '''


class Callbacks:
    """Handles all registered callbacks for YOLO hooks."""

    def __init__(self):
        self._callbacks = {
            "on_pretrain_routine_start": [],
            "on_pretrain_routine_end": [],
            "on_train_start": [],
            "on_train_epoch_start": [],
            "on_train_batch_start": [],
            "optimizer_step": [],
            "on_before_zero_grad": [],
            "on_train_batch_end": [],
            "on_train_epoch_end": [],
            "on_val_start": [],
            "on_val_batch_start": [],
            "on_val_image_end": [],
            "on_val_batch_end": [],
            "on_val_end": [],
            "on_fit_epoch_end": [],
            "on_model_save": [],
            "on_train_end": [],
            "on_params_update": [],
            "teardown": [],
        }
        self.stop_training = False

    def register_action(self, hook, name="", callback=None):
        assert hook in self._callbacks, f"hook '{hook}' not found in callbacks {self._callbacks}"
        assert callable(callback), f"callback '{callback}' is not callable"
        self._callbacks[hook].append({"name": name, "callback": callback})

    def get_registered_actions(self, hook=None):
        return self._callbacks[hook] if hook else self._callbacks

    def run(self, hook, *args, thread=False, **kwargs):
        assert hook in self._callbacks, f"hook '{hook}' not found in callbacks {self._callbacks}"
        for logger in self._callbacks[hook]:
            logger["callback"](*args, **kwargs)
'''

_LOGGERS = '''
from utils.general import LOGGER, colorstr_0
from utils.plots import plot_images_0

LOGGERS = ("csv", "tb", "wandb", "clearml", "comet")


class Loggers:
    """Training loggers."""

    def __init__(self, save_dir=None, weights=None, opt=None, hyp=None, logger=None, include=LOGGERS):
        self.save_dir = save_dir
        self.weights = weights
        self.opt = opt
        self.hyp = hyp
        self.logger = logger
        self.include = include
        self.keys = [
            "train/box_loss",
            "train/obj_loss",
            "train/cls_loss",
            "metrics/precision",
            "metrics/recall",
            "metrics/mAP_0.5",
            "metrics/mAP_0.5:0.95",
            "val/box_loss",
            "val/obj_loss",
            "val/cls_loss",
            "x/lr0",
            "x/lr1",
            "x/lr2",
        ]
        self.csv = True
        self.tb = None
        if "tb" in self.include and not self.opt.evolve:
            prefix = colorstr_0("TensorBoard: ")
            LOGGER.info(f"{prefix}Start with 'tensorboard --logdir {self.save_dir.parent}'")

    def on_train_batch_end(self, model, ni, imgs, targets, paths, vals):
        log_dict = dict(zip(self.keys[:3], vals))
        if self.plots:
            if ni < 3:
                f = self.save_dir / f"train_batch{ni}.jpg"
                plot_images_0(imgs, targets, paths, f)

    def on_fit_epoch_end(self, vals, epoch, best_fitness, fi):
        x = dict(zip(self.keys, vals))
        if self.csv:
            file = self.save_dir / "results.csv"
            n = len(x) + 1
            s = "" if file.exists() else (("%20s," * n % tuple(["epoch"] + self.keys)).rstrip(",") + "\\n")
            with open(file, "a") as f:
                f.write(s + ("%20.5g," * n % tuple([epoch] + vals)).rstrip(",") + "\\n")
        if self.tb:
            for k, v in x.items():
                self.tb.add_scalar(k, v, epoch)

    def on_model_save(self, last, epoch, final_epoch, best_fitness, fi):
        if (epoch + 1) % self.opt.save_period == 0 and not final_epoch and self.opt.save_period != -1:
            LOGGER.info(f"saved {last}")

    def on_train_end(self, last, best, epoch, results):
        files = ["results.png", "confusion_matrix.png", *(f"{x}_curve.png" for x in ("F1", "PR", "P", "R"))]
        files = [(self.save_dir / f) for f in files if (self.save_dir / f).exists()]
        LOGGER.info(f"Results saved to {colorstr_0('bold', self.save_dir)}")
'''

_AUTOANCHOR = '''
from utils.general import LOGGER, colorstr_0

PREFIX = colorstr_0("AutoAnchor: ")


def check_anchor_order(m):
    """Check anchor order against stride order for YOLO Detect() module m, and correct if necessary."""
    a = m.anchors.prod(-1).mean(-1).view(-1)
    da = a[-1] - a[0]
    ds = m.stride[-1] - m.stride[0]
    if da and (da.sign() != ds.sign()):
        LOGGER.info(f"{PREFIX}Reversing anchor order")
        m.anchors[:] = m.anchors.flip(0)


def check_anchors(dataset, model, thr=4.0, imgsz=640):
    """Check anchor fit to data, recompute if necessary."""
    m = model.module.model[-1] if hasattr(model, "module") else model.model[-1]
    shapes = imgsz * dataset.shapes / dataset.shapes.max(1, keepdims=True)
    scale = np.random.uniform(0.9, 1.1, size=(shapes.shape[0], 1))
    wh = torch.tensor(np.concatenate([l[:, 3:5] * s for s, l in zip(shapes * scale, dataset.labels)])).float()

    def metric(k):
        r = wh[:, None] / k[None]
        x = torch.min(r, 1 / r).min(2)[0]
        best = x.max(1)[0]
        aat = (x > 1 / thr).float().sum(1).mean()
        bpr = (best > 1 / thr).float().mean()
        return bpr, aat

    stride = m.stride.to(m.anchors.device).view(-1, 1, 1)
    anchors = m.anchors.clone() * stride
    bpr, aat = metric(anchors.cpu().view(-1, 2))
    s = f"\\n{PREFIX}{aat:.2f} anchors/target, {bpr:.3f} Best Possible Recall (BPR). "
    if bpr > 0.98:
        LOGGER.info(f"{s}Current anchors are a good fit to dataset")
    else:
        LOGGER.info(f"{s}Anchors are a poor fit to dataset, attempting to improve...")
        na = m.anchors.numel() // 2
        anchors = kmean_anchors(dataset, n=na, img_size=imgsz, thr=thr, gen=1000, verbose=False)
        new_bpr = metric(anchors)[0]
        if new_bpr > bpr:
            anchors = torch.tensor(anchors, device=m.anchors.device).type_as(m.anchors)
            m.anchors[:] = anchors.clone().view_as(m.anchors)
            check_anchor_order(m)
            m.anchors /= stride


def kmean_anchors(dataset="./data/coco128.yaml", n=9, img_size=640, thr=4.0, gen=1000, verbose=True):
    """Creates kmeans-evolved anchors from training dataset."""
    thr = 1 / thr

    def metric(k, wh):
        r = wh[:, None] / k[None]
        x = torch.min(r, 1 / r).min(2)[0]
        return x, x.max(1)[0]

    def anchor_fitness(k):
        _, best = metric(torch.tensor(k, dtype=torch.float32), wh)
        return (best * (best > thr).float()).mean()

    wh0 = np.concatenate([l[:, 3:5] for l in dataset.labels])
    wh = wh0[(wh0 >= 2.0).any(1)].astype(np.float32)
    k = np.random.rand(n * 2).reshape(n, 2) * img_size
    f, sh, mp, s = anchor_fitness(k), k.shape, 0.9, 0.1
    for _ in range(gen):
        v = np.ones(sh)
        while (v == 1).all():
            v = ((np.random.random(sh) < mp) * random.random() * np.random.randn(*sh) * s + 1).clip(0.3, 3.0)
        kg = (k.copy() * v).clip(min=2.0)
        fg = anchor_fitness(kg)
        if fg > f:
            f, k = fg, kg.copy()
    return k
'''

_TRAIN = '''
import val as validate
from models.experimental import attempt_load
from models.yolo import Model
from utils.autoanchor import check_anchors
from utils.callbacks import Callbacks
from utils.datasets import create_dataloader_0
from utils.general import LOGGER, check_file_0, colorstr_0, increment_path_0, strip_optimizer
from utils.loggers import Loggers
from utils.loss import ComputeLoss
from utils.metrics import fitness_0
from utils.torch_utils import EarlyStopping, ModelEMA, de_parallel, smart_optimizer, torch_distributed_zero_first

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))


def train(hyp, opt, device, callbacks):
    """Train a YOLO model on a custom dataset."""
    save_dir, epochs, batch_size, weights, single_cls, evolve, data, cfg, resume, noval, nosave, workers, freeze = (
        Path(opt.save_dir),
        opt.epochs,
        opt.batch_size,
        opt.weights,
        opt.single_cls,
        opt.evolve,
        opt.data,
        opt.cfg,
        opt.resume,
        opt.noval,
        opt.nosave,
        opt.workers,
        opt.freeze,
    )
    callbacks.run("on_pretrain_routine_start")
    w = save_dir / "weights"
    w.mkdir(parents=True, exist_ok=True)
    last, best = w / "last.pt", w / "best.pt"
    LOGGER.info(colorstr_0("hyperparameters: ") + ", ".join(f"{k}={v}" for k, v in hyp.items()))
    opt.hyp = hyp.copy()
    if RANK in {-1, 0}:
        loggers = Loggers(save_dir, weights, opt, hyp, LOGGER)
        for k in methods(loggers):
            callbacks.register_action(k, callback=getattr(loggers, k))
    plots = not evolve and not opt.noplots
    cuda = device.type != "cpu"
    init_seeds(opt.seed + 1 + RANK, deterministic=True)
    with torch_distributed_zero_first(LOCAL_RANK):
        data_dict = check_dataset(data)
    train_path, val_path = data_dict["train"], data_dict["val"]
    nc = 1 if single_cls else int(data_dict["nc"])
    names = {0: "item"} if single_cls and len(data_dict["names"]) != 1 else data_dict["names"]
    pretrained = weights.endswith(".pt")
    if pretrained:
        with torch_distributed_zero_first(LOCAL_RANK):
            weights = attempt_download(weights)
        ckpt = torch.load(weights, map_location="cpu")
        model = Model(cfg or ckpt["model"].yaml, ch=3, nc=nc, anchors=hyp.get("anchors")).to(device)
        exclude = ["anchor"] if (cfg or hyp.get("anchors")) and not resume else []
        csd = ckpt["model"].float().state_dict()
        model.load_state_dict(csd, strict=False)
        LOGGER.info(f"Transferred {len(csd)}/{len(model.state_dict())} items from {weights}")
    else:
        model = Model(cfg, ch=3, nc=nc, anchors=hyp.get("anchors")).to(device)
    amp = check_amp(model)
    freeze = [f"model.{x}." for x in (freeze if len(freeze) > 1 else range(freeze[0]))]
    for k, v in model.named_parameters():
        v.requires_grad = True
        if any(x in k for x in freeze):
            LOGGER.info(f"freezing {k}")
            v.requires_grad = False
    gs = max(int(model.stride.max()), 32)
    imgsz = check_img_size(opt.imgsz, gs, floor=gs * 2)
    nbs = 64
    accumulate = max(round(nbs / batch_size), 1)
    hyp["weight_decay"] *= batch_size * accumulate / nbs
    optimizer = smart_optimizer(model, opt.optimizer, hyp["lr0"], hyp["momentum"], hyp["weight_decay"])
    if opt.cos_lr:
        lf = one_cycle(1, hyp["lrf"], epochs)
    else:

        def lf(x):
            return (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model) if RANK in {-1, 0} else None
    best_fitness, start_epoch = 0.0, 0
    if pretrained:
        if resume:
            best_fitness, start_epoch, epochs = smart_resume(ckpt, optimizer, ema, weights, epochs, resume)
        del ckpt, csd
    if cuda and RANK == -1 and torch.cuda.device_count() > 1:
        LOGGER.warning("WARNING: DP not recommended, use torch.distributed.run for best DDP Multi-GPU results.")
        model = torch.nn.DataParallel(model)
    train_loader, dataset = create_dataloader_0(
        train_path,
        imgsz,
        batch_size // WORLD_SIZE,
        gs,
        hyp=hyp,
        augment=True,
        rank=LOCAL_RANK,
        workers=workers,
        shuffle=True,
        prefix=colorstr_0("train: "),
    )
    labels = np.concatenate(dataset.labels, 0)
    mlc = int(labels[:, 0].max())
    assert mlc < nc, f"Label class {mlc} exceeds nc={nc} in {data}. Possible class labels are 0-{nc - 1}"
    if RANK in {-1, 0}:
        val_loader = create_dataloader_0(
            val_path, imgsz, batch_size // WORLD_SIZE * 2, gs, hyp=hyp, rank=-1, workers=workers * 2, prefix=colorstr_0("val: ")
        )[0]
        if not resume:
            if not opt.noautoanchor:
                check_anchors(dataset, model=model, thr=hyp["anchor_t"], imgsz=imgsz)
            model.half().float()
        callbacks.run("on_pretrain_routine_end", labels, names)
    nl = de_parallel(model).model[-1].nl
    hyp["box"] *= 3 / nl
    hyp["cls"] *= nc / 80 * 3 / nl
    hyp["obj"] *= (imgsz / 640) ** 2 * 3 / nl
    model.nc = nc
    model.hyp = hyp
    model.names = names
    t0 = time.time()
    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    maps = np.zeros(nc)
    results = (0, 0, 0, 0, 0, 0, 0)
    scheduler.last_epoch = start_epoch - 1
    scaler = torch.cuda.amp.GradScaler(enabled=amp)
    stopper, stop = EarlyStopping(patience=opt.patience), False
    compute_loss = ComputeLoss(model)
    callbacks.run("on_train_start")
    LOGGER.info(f"Image sizes {imgsz} train, {imgsz} val\\nStarting training for {epochs} epochs...")
    for epoch in range(start_epoch, epochs):
        callbacks.run("on_train_epoch_start")
        model.train()
        mloss = torch.zeros(3, device=device)
        if RANK != -1:
            train_loader.sampler.set_epoch(epoch)
        pbar = enumerate(train_loader)
        LOGGER.info(("\\n" + "%11s" * 7) % ("Epoch", "GPU_mem", "box_loss", "obj_loss", "cls_loss", "Instances", "Size"))
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in pbar:
            callbacks.run("on_train_batch_start")
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255
            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]])
            if opt.multi_scale:
                sz = random.randrange(int(imgsz * 0.5), int(imgsz * 1.5) + gs) // gs * gs
                sf = sz / max(imgs.shape[2:])
                if sf != 1:
                    ns = [math.ceil(x * sf / gs) * gs for x in imgs.shape[2:]]
                    imgs = nn.functional.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)
            with torch.cuda.amp.autocast(amp):
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
                if RANK != -1:
                    loss *= WORLD_SIZE
                if opt.quad:
                    loss *= 4.0
            scaler.scale(loss).backward()
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if ema:
                    ema.update(model)
                last_opt_step = ni
            if RANK in {-1, 0}:
                mloss = (mloss * i + loss_items) / (i + 1)
                mem = f"{torch.cuda.memory_reserved() / 1e9 if torch.cuda.is_available() else 0:.3g}G"
                callbacks.run("on_train_batch_end", model, ni, imgs, targets, paths, list(mloss))
                if callbacks.stop_training:
                    return
        lr = [x["lr"] for x in optimizer.param_groups]
        scheduler.step()
        if RANK in {-1, 0}:
            callbacks.run("on_train_epoch_end", epoch=epoch)
            ema.update_attr(model, include=["yaml", "nc", "hyp", "names", "stride", "class_weights"])
            final_epoch = (epoch + 1 == epochs) or stopper.possible_stop
            if not noval or final_epoch:
                results, maps, _ = validate.run(
                    data_dict,
                    batch_size=batch_size // WORLD_SIZE * 2,
                    imgsz=imgsz,
                    half=amp,
                    model=ema.ema,
                    single_cls=single_cls,
                    dataloader=val_loader,
                    save_dir=save_dir,
                    plots=False,
                    callbacks=callbacks,
                    compute_loss=compute_loss,
                )
            fi = fitness_0(np.array(results).reshape(1, -1))
            stop = stopper(epoch=epoch, fitness=fi)
            if fi > best_fitness:
                best_fitness = fi
            log_vals = list(mloss) + list(results) + lr
            callbacks.run("on_fit_epoch_end", log_vals, epoch, best_fitness, fi)
            if (not nosave) or (final_epoch and not evolve):
                ckpt = {
                    "epoch": epoch,
                    "best_fitness": best_fitness,
                    "model": deepcopy(de_parallel(model)).half(),
                    "ema": deepcopy(ema.ema).half(),
                    "updates": ema.updates,
                    "optimizer": optimizer.state_dict(),
                    "opt": vars(opt),
                    "date": time.ctime(),
                }
                torch.save(ckpt, last)
                if best_fitness == fi:
                    torch.save(ckpt, best)
                if opt.save_period > 0 and epoch % opt.save_period == 0:
                    torch.save(ckpt, w / f"epoch{epoch}.pt")
                del ckpt
                callbacks.run("on_model_save", last, epoch, final_epoch, best_fitness, fi)
        if stop:
            break
    if RANK in {-1, 0}:
        LOGGER.info(f"\\n{epoch - start_epoch + 1} epochs completed in {(time.time() - t0) / 3600:.3f} hours.")
        for f in last, best:
            if f.exists():
                strip_optimizer(f)
                if f is best:
                    LOGGER.info(f"\\nValidating {f}...")
                    results, _, _ = validate.run(
                        data_dict,
                        batch_size=batch_size // WORLD_SIZE * 2,
                        imgsz=imgsz,
                        model=attempt_load(f, device).half(),
                        iou_thres=0.60,
                        single_cls=single_cls,
                        dataloader=val_loader,
                        save_dir=save_dir,
                        save_json=False,
                        verbose=True,
                        plots=plots,
                        callbacks=callbacks,
                        compute_loss=compute_loss,
                    )
        callbacks.run("on_train_end", last, best, epoch, results)
    torch.cuda.empty_cache()
    return results


def main(opt, callbacks=Callbacks()):
    """Runs training or hyperparameter evolution with specified options and optional callbacks."""
    if RANK in {-1, 0}:
        LOGGER.info(str(opt))
    opt.data, opt.cfg, opt.hyp, opt.weights, opt.project = (
        check_file_0(opt.data),
        check_file_0(opt.cfg),
        check_file_0(opt.hyp),
        str(opt.weights),
        str(opt.project),
    )
    opt.save_dir = str(increment_path_0(Path(opt.project) / opt.name, exist_ok=opt.exist_ok))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if LOCAL_RANK != -1:
        assert torch.cuda.device_count() > LOCAL_RANK, "insufficient CUDA devices for DDP command"
        torch.cuda.set_device(LOCAL_RANK)
        device = torch.device("cuda", LOCAL_RANK)
    train(opt.hyp, opt, device, callbacks)
'''

_VAL = '''
from models.experimental import attempt_load
from utils.callbacks import Callbacks
from utils.datasets import create_dataloader_0
from utils.general import LOGGER, check_file_0, colorstr_0, increment_path_0, non_max_suppression, xywh2xyxy_0
from utils.metrics import ap_per_class_0, bbox_iou_0
from utils.plots import output_to_target_0, plot_images_0
from utils.torch_utils import de_parallel, time_sync_0


def process_batch(detections, labels, iouv):
    """Return correct prediction matrix: detections (n, 6) [x1, y1, x2, y2, conf, class]."""
    correct = np.zeros((detections.shape[0], iouv.shape[0])).astype(bool)
    iou = bbox_iou_0(labels[:, 1:], detections[:, :4])
    correct_class = labels[:, 0:1] == detections[:, 5]
    for i in range(len(iouv)):
        x = torch.where((iou >= iouv[i]) & correct_class)
        if x[0].shape[0]:
            matches = torch.cat((torch.stack(x, 1), iou[x[0], x[1]][:, None]), 1).cpu().numpy()
            if x[0].shape[0] > 1:
                matches = matches[matches[:, 2].argsort()[::-1]]
                matches = matches[np.unique(matches[:, 1], return_index=True)[1]]
                matches = matches[np.unique(matches[:, 0], return_index=True)[1]]
            correct[matches[:, 1].astype(int), i] = True
    return torch.tensor(correct, dtype=torch.bool, device=iouv.device)


@torch.no_grad()
def run(
    data,
    weights=None,
    batch_size=32,
    imgsz=640,
    conf_thres=0.001,
    iou_thres=0.6,
    max_det=300,
    task="val",
    device="",
    workers=8,
    single_cls=False,
    augment=False,
    verbose=False,
    save_txt=False,
    save_json=False,
    project="runs/val",
    name="exp",
    exist_ok=False,
    half=True,
    model=None,
    dataloader=None,
    save_dir=Path(""),
    plots=True,
    callbacks=Callbacks(),
    compute_loss=None,
):
    """Evaluates a YOLO model on a dataset and logs performance metrics."""
    training = model is not None
    if training:
        device, pt = next(model.parameters()).device, True
        half &= device.type != "cpu"
        model.half() if half else model.float()
    else:
        save_dir = increment_path_0(Path(project) / name, exist_ok=exist_ok)
        model = attempt_load(weights, device=device)
        stride, pt = 32, True
        imgsz = 640
        half = model.fp16
    model.eval()
    cuda = device.type != "cpu"
    nc = 1 if single_cls else int(data["nc"])
    iouv = torch.linspace(0.5, 0.95, 10, device=device)
    niou = iouv.numel()
    if not training:
        dataloader = create_dataloader_0(data[task], imgsz, batch_size, 32, rank=-1, workers=workers, prefix=colorstr_0(f"{task}: "))[0]
    seen = 0
    names = model.names if hasattr(model, "names") else model.module.names
    s = ("%22s" + "%11s" * 6) % ("Class", "Images", "Instances", "P", "R", "mAP50", "mAP50-95")
    tp, fp, p, r, f1, mp, mr, map50, ap50, map = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    dt = [0.0, 0.0, 0.0]
    loss = torch.zeros(3, device=device)
    stats, ap, ap_class = [], [], []
    callbacks.run("on_val_start")
    for batch_i, (im, targets, paths, shapes) in enumerate(dataloader):
        callbacks.run("on_val_batch_start")
        t1 = time_sync_0()
        if cuda:
            im = im.to(device, non_blocking=True)
            targets = targets.to(device)
        im = im.half() if half else im.float()
        im /= 255
        nb, _, height, width = im.shape
        t2 = time_sync_0()
        dt[0] += t2 - t1
        preds, train_out = model(im) if compute_loss else (model(im, augment=augment), None)
        dt[1] += time_sync_0() - t2
        if compute_loss:
            loss += compute_loss(train_out, targets)[1]
        targets[:, 2:] *= torch.tensor((width, height, width, height), device=device)
        t3 = time_sync_0()
        preds = non_max_suppression(preds, conf_thres, iou_thres, max_det=max_det)
        dt[2] += time_sync_0() - t3
        for si, pred in enumerate(preds):
            labels = targets[targets[:, 0] == si, 1:]
            nl, npr = labels.shape[0], pred.shape[0]
            path, shape = Path(paths[si]), shapes[si][0]
            correct = torch.zeros(npr, niou, dtype=torch.bool, device=device)
            seen += 1
            if npr == 0:
                if nl:
                    stats.append((correct, *torch.zeros((2, 0), device=device), labels[:, 0]))
                continue
            if single_cls:
                pred[:, 5] = 0
            predn = pred.clone()
            if nl:
                tbox = xywh2xyxy_0(labels[:, 1:5])
                labelsn = torch.cat((labels[:, 0:1], tbox), 1)
                correct = process_batch(predn, labelsn, iouv)
            stats.append((correct, pred[:, 4], pred[:, 5], labels[:, 0]))
            callbacks.run("on_val_image_end", pred, predn, path, names, im[si])
        if plots and batch_i < 3:
            plot_images_0(im, targets, paths, save_dir / f"val_batch{batch_i}_labels.jpg", names)
            plot_images_0(im, output_to_target_0(preds), paths, save_dir / f"val_batch{batch_i}_pred.jpg", names)
        callbacks.run("on_val_batch_end", batch_i, im, targets, paths, shapes, preds)
    stats = [torch.cat(x, 0).cpu().numpy() for x in zip(*stats)]
    if len(stats) and stats[0].any():
        tp, fp, p, r, f1, ap, ap_class = ap_per_class_0(*stats, plot=plots, save_dir=save_dir, names=names)
        ap50, ap = ap[:, 0], ap.mean(1)
        mp, mr, map50, map = p.mean(), r.mean(), ap50.mean(), ap.mean()
    nt = np.bincount(stats[3].astype(int), minlength=nc)
    pf = "%22s" + "%11i" * 2 + "%11.3g" * 4
    LOGGER.info(pf % ("all", seen, nt.sum(), mp, mr, map50, map))
    if (verbose or (nc < 50 and not training)) and nc > 1 and len(stats):
        for i, c in enumerate(ap_class):
            LOGGER.info(pf % (names[c], seen, nt[c], p[i], r[i], ap50[i], ap[i]))
    t = tuple(x / seen * 1e3 for x in dt)
    if not training:
        shape = (batch_size, 3, imgsz, imgsz)
        LOGGER.info(f"Speed: %.1fms pre-process, %.1fms inference, %.1fms NMS per image at shape {shape}" % t)
    model.float()
    maps = np.zeros(nc) + map
    for i, c in enumerate(ap_class):
        maps[c] = ap[i]
    return (mp, mr, map50, map, *(loss.cpu() / len(dataloader)).tolist()), maps, t
'''

_DETECT = '''
from models.experimental import attempt_load
from utils.augmentations import letterbox_0
from utils.general import LOGGER, check_file_0, colorstr_0, increment_path_0, non_max_suppression, xywh2xyxy_0
from utils.plots import Colors0
from utils.torch_utils import time_sync_0


@torch.no_grad()
def run(weights="yolov5s.pt", source="data/images", imgsz=(640, 640), conf_thres=0.25, iou_thres=0.45, max_det=1000, device="", view_img=False, save_txt=False, nosave=False, classes=None, augment=False, project="runs/detect", name="exp", exist_ok=False, half=False):
    """Runs YOLO detection inference on various sources like images, videos, directories, streams."""
    source = str(source)
    save_img = not nosave and not source.endswith(".txt")
    is_file = Path(source).suffix[1:] in ("jpg", "png", "mp4")
    is_url = source.lower().startswith(("rtsp://", "rtmp://", "http://", "https://"))
    if is_url and is_file:
        source = check_file_0(source)
    save_dir = increment_path_0(Path(project) / name, exist_ok=exist_ok)
    (save_dir / "labels" if save_txt else save_dir).mkdir(parents=True, exist_ok=True)
    model = attempt_load(weights, device=device)
    stride, names = 32, model.names
    colors = Colors0()
    seen, windows, dt = 0, [], [0.0, 0.0, 0.0]
    for path, im, im0s, vid_cap, s in []:
        t1 = time_sync_0()
        im = torch.from_numpy(im).to(model.device)
        im = im.half() if half else im.float()
        im /= 255
        if len(im.shape) == 3:
            im = im[None]
        t2 = time_sync_0()
        dt[0] += t2 - t1
        pred = model(im, augment=augment)
        t3 = time_sync_0()
        dt[1] += t3 - t2
        pred = non_max_suppression(pred, conf_thres, iou_thres, classes, max_det=max_det)
        dt[2] += time_sync_0() - t3
        for i, det in enumerate(pred):
            seen += 1
            p, im0 = path, im0s.copy()
            p = Path(p)
            save_path = str(save_dir / p.name)
            s += "%gx%g " % im.shape[2:]
            gn = torch.tensor(im0.shape)[[1, 0, 1, 0]]
            if len(det):
                for c in det[:, 5].unique():
                    n = (det[:, 5] == c).sum()
                    s += f"{n} {names[int(c)]}{'s' * (n > 1)}, "
                for *xyxy, conf, cls in reversed(det):
                    if save_txt:
                        xywh = (xywh2xyxy_0(torch.tensor(xyxy).view(1, 4)) / gn).view(-1).tolist()
                        line = (cls, *xywh, conf)
                        with open(f"{save_path}.txt", "a") as f:
                            f.write(("%g " * len(line)).rstrip() % line + "\\n")
                    if save_img or view_img:
                        c = int(cls)
                        label = f"{names[c]} {conf:.2f}"
                        color = colors(c, True)
            LOGGER.info(f"{s}{'' if len(det) else '(no detections), '}{dt[1] * 1e3:.1f}ms")
    t = tuple(x / max(seen, 1) * 1e3 for x in dt)
    LOGGER.info(f"Speed: %.1fms pre-process, %.1fms inference, %.1fms NMS per image at shape {(1, 3, *imgsz)}" % t)
    if save_txt or save_img:
        LOGGER.info(f"Results saved to {colorstr_0('bold', save_dir)}")
'''

_EXPORT = '''
from models.experimental import attempt_load
from models.yolo import Detect
from utils.general import LOGGER, check_file_0, colorstr_0
from utils.torch_utils import time_sync_0


def export_torchscript(model, im, file, optimize, prefix=colorstr_0("TorchScript:")):
    """Exports a YOLO model to TorchScript format."""
    LOGGER.info(f"\\n{prefix} starting export with torch {torch.__version__}...")
    f = file.with_suffix(".torchscript")
    ts = torch.jit.trace(model, im, strict=False)
    ts.save(str(f))
    return f, None


def export_onnx(model, im, file, opset, dynamic, simplify, prefix=colorstr_0("ONNX:")):
    """Exports a YOLO model to ONNX format with dynamic axes and optional simplification."""
    f = str(file.with_suffix(".onnx"))
    output_names = ["output0"]
    if dynamic:
        dynamic = {"images": {0: "batch", 2: "height", 3: "width"}}
        dynamic["output0"] = {0: "batch", 1: "anchors"}
    torch.onnx.export(
        model.cpu() if dynamic else model,
        im.cpu() if dynamic else im,
        f,
        verbose=False,
        opset_version=opset,
        do_constant_folding=True,
        input_names=["images"],
        output_names=output_names,
        dynamic_axes=dynamic or None,
    )
    return f, None


@torch.no_grad()
def run(weights="yolov5s.pt", imgsz=(640, 640), batch_size=1, device="cpu", include=("torchscript", "onnx"), half=False, inplace=False, optimize=False, dynamic=False, simplify=False, opset=12):
    """Exports a YOLO model to specified formats including ONNX, TensorRT, CoreML, and TensorFlow."""
    t = time.time()
    include = [x.lower() for x in include]
    file = Path(check_file_0(weights))
    model = attempt_load(weights, device=device, inplace=True, fuse=True)
    gs = int(max(model.stride))
    im = torch.zeros(batch_size, 3, *imgsz).to(device)
    model.eval()
    for k, m in model.named_modules():
        if isinstance(m, Detect):
            m.inplace = inplace
            m.dynamic = dynamic
            m.export = True
    for _ in range(2):
        y = model(im)
    if half:
        im, model = im.half(), model.half()
    f = [""] * 2
    if "torchscript" in include:
        f[0], _ = export_torchscript(model, im, file, optimize)
    if "onnx" in include:
        f[1], _ = export_onnx(model, im, file, opset, dynamic, simplify)
    f = [str(x) for x in f if x]
    if any(f):
        LOGGER.info(f"\\nExport complete ({time.time() - t:.1f}s)\\nResults saved to {colorstr_0('bold', file.parent.resolve())}")
    return f
'''

_HUBCONF = '''
from models.common import AutoShape
from models.experimental import attempt_load
from models.yolo import DetectionModel
from utils.general import LOGGER, check_file_0
from utils.torch_utils import de_parallel


def _create(name, pretrained=True, channels=3, classes=80, autoshape=True, verbose=True, device=None):
    """Creates or loads a YOLO model."""
    path = Path(name).with_suffix(".pt") if Path(name).suffix == "" and not Path(name).is_dir() else Path(name)
    try:
        if pretrained and channels == 3 and classes == 80:
            model = attempt_load(path, device=device, fuse=False)
            if autoshape:
                model = AutoShape(model)
        else:
            cfg = list((Path(__file__).parent / "models").rglob(f"{path.stem}.yaml"))[0]
            model = DetectionModel(cfg, channels, classes)
            if pretrained:
                ckpt = torch.load(check_file_0(path), map_location=device)
                csd = ckpt["model"].float().state_dict()
                model.load_state_dict(csd, strict=False)
        return model.to(device)
    except Exception as e:
        s = "Cache may be out of date, try `force_reload=True`."
        e.message = f"{e}. {s}"
        raise Exception(e) from e
'''

_HUB_MODEL = '''

def yolov5{i}(pretrained=True, channels=3, classes=80, autoshape=True, _verbose=True, device=None):
    """Creates YOLO model variant {i} with options for pretraining, channels, classes, autoshaping."""
    return _create("yolov5{i}", pretrained, channels, classes, autoshape, _verbose, device)
'''


def _repeat(template: str, count: int) -> str:
    return "".join(template.format(i=i) for i in range(count))


# relative path -> (docstring, body)
MODULES: dict[str, tuple[str, str]] = {
    "models/__init__.py": ("Models.", ""),
    "models/common.py": (
        "Common modules.",
        "\nfrom torch.cuda import amp\n\nfrom utils.general import LOGGER, colorstr_0, "
        "non_max_suppression, xywh2xyxy_0\n"
        "from utils.torch_utils import smart_inference_mode\n"
        + _repeat(_COMMON_BLOCK, 28)
        + _COMMON_TAIL,
    ),
    "models/yolo.py": ("YOLO-specific modules.", _YOLO),
    "models/experimental.py": (
        "Experimental modules.",
        _EXPERIMENTAL + _repeat(_EXPERIMENTAL_BLOCK, 16),
    ),
    "utils/__init__.py": ("Utilities.", ""),
    "utils/general.py": ("General utils.", _repeat(_GENERAL_FUNC, 50) + _GENERAL_TAIL),
    "utils/torch_utils.py": (
        "PyTorch utils.",
        "\nfrom utils.general import LOGGER, colorstr_0\n\n\ndef smart_inference_mode():\n"
        "    return torch.inference_mode()\n" + _TORCH_UTILS + _repeat(_TORCH_UTILS_FUNC, 20),
    ),
    "utils/loss.py": ("Loss functions.", _LOSS),
    "utils/metrics.py": ("Model validation metrics.", _repeat(_METRICS_FUNC, 22)),
    "utils/plots.py": (
        "Plotting utils.",
        "\nfrom utils.general import LOGGER, colorstr_0\n" + _repeat(_PLOTS_FUNC, 18),
    ),
    "utils/datasets.py": (
        "Dataloaders and dataset utils.",
        "\nfrom utils.augmentations import letterbox_0, random_perspective_0\n"
        "from utils.general import LOGGER, RANK, colorstr_0, xywh2xyxy_0\n"
        "from utils.torch_utils import torch_distributed_zero_first\n"
        + _repeat(_DATASETS_FUNC, 16),
    ),
    "utils/augmentations.py": ("Image augmentation functions.", _repeat(_AUGMENT_FUNC, 16)),
    "utils/autoanchor.py": ("AutoAnchor utils.", _AUTOANCHOR),
    "utils/callbacks.py": ("Callback utils.", _CALLBACKS),
    "utils/loggers/__init__.py": ("Logging utils.", _LOGGERS),
    "train.py": ("Train a YOLO model on a custom dataset.", _TRAIN),
    "val.py": ("Validate a trained YOLO detection model on a detection dataset.", _VAL),
    "segment/__init__.py": ("Segmentation scripts.", ""),
    "segment/train.py": (
        "Train a YOLO segmentation model.",
        _TRAIN.replace("import val as", "import segment.val as"),
    ),
    "segment/val.py": ("Validate a YOLO segmentation model.", _VAL),
    "classify/__init__.py": ("Classification scripts.", ""),
    "classify/train.py": (
        "Train a YOLO classification model.",
        _TRAIN.replace("import val as", "import classify.val as"),
    ),
    "classify/val.py": ("Validate a YOLO classification model.", _VAL),
    "detect.py": ("Run YOLO detection inference on images, videos, directories.", _DETECT),
    "export.py": ("Export a YOLO PyTorch model to other formats.", _EXPORT),
    "hubconf.py": (
        "PyTorch Hub models.",
        _HUBCONF + _repeat(_HUB_MODEL, 12),
    ),
}


def write_tree(root: str) -> list[str]:
    """Write the tree under ``root`` (created if missing); returns the files written, sorted."""
    written = []
    for rel, (doc, body) in MODULES.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        text = _HEADER.format(doc=doc) + textwrap.dedent(body)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        written.append(path)
    return sorted(written)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/yolo_tree.py DIR")
    files = write_tree(sys.argv[1])
    lines = sum(open(f, encoding="utf-8").read().count("\n") for f in files)
    print(f"{len(files)} files, {lines} lines under {sys.argv[1]}")
