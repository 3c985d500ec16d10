"""Lua scripts of the shared fair queue (layout and algorithm in `router/fairness/shared.py`).

One script per event, all atomic: SYNC (a router's heartbeat and its state: in-flight slots,
batch KV held, backlogged tenants with their head's age, decode charges since its last call;
TTL 0 = the router leaves, its state goes at once), ADMIT (SYNC, then grant one slot to this
router's fairest waiting tenant when it is that tenant's turn fleet-wide), VIEW (the shared
state, for tests and operators). Each takes the time from Redis `TIME` (tests may pass `now` in
ms) and starts with the sweeper: routers whose heartbeat expired (at most 8 per call) lose their
backlog and their slots. A call that frees slots (a release, a router gone) while requests wait
publishes its router id on `P:wake`, so the other routers ask at once instead of at their next
tick. Keys hold tenant ids, router ids and numbers only.

ARGV of SYNC/ADMIT: 1 key prefix, 2 now ('' = Redis TIME), 3 router id, 4 heartbeat TTL ms
(0 = leave), 5 this router's in-flight requests, 6 its batch KV tokens, 7 fleet slots, 8 fleet
batch KV tokens, 9 grant (1 = ADMIT), 10 charge batch id (applied once: only when above the last
one applied for this router), 11 nc, then nc x (tenant, counter delta), then nb, then nb x
(tenant, class 0 interactive | 1 batch, requests queued here, head's prefill charge, head's
reserved tokens, head's age in ms) for every tenant backlogged at this router.

Reply: {1, tenant, counter after the charge, live routers, free slots, backlogged tenants} when a
slot was granted (to the head of `tenant` here), else {0, reason, '', live routers, free slots,
backlogged tenants}; reason = idle | full | turn | order | priority | batch_kv | synced | left;
free slots = the fleet's slots minus every live router's in-flight requests after the call,
backlogged tenants = tenants waiting at any live router after the call. Floats cross as strings
(`%.17g`, exact); counters never go below 0.
"""

from __future__ import annotations

from controlplane.store.scripts import LUA_NOW

_COMMON = (
    r"""
local P, R = ARGV[1], ARGV[3]
"""
    + LUA_NOW
    + r"""
local ROUTERS, INF, BKV, SEQ = P .. ':routers', P .. ':inf', P .. ':bkv', P .. ':seq'
local BL, CLS, VC, ST = P .. ':bl', P .. ':cls', P .. ':vc', P .. ':stats'
local KEEP = 3600000
local ORDER_MS = 2
local WAKE = P .. ':wake'
local function Q(r) return P .. ':q:' .. r end
local function HD(t) return P .. ':hd:' .. t end
local wake = false
local function num(x) return string.format('%.0f', x) end
local function flt(x) return string.format('%.17g', x) end
local function counter(t) return tonumber(redis.call('HGET', VC, t) or '0') end
local function unbacklog(r, t)
  if redis.call('SREM', Q(r), t) == 1 then
    if redis.call('HINCRBY', BL, t, -1) <= 0 then redis.call('HDEL', BL, t) end
  end
  redis.call('HDEL', HD(t), r)
end
local function drop(r)
  for _, t in ipairs(redis.call('SMEMBERS', Q(r))) do unbacklog(r, t) end
  redis.call('DEL', Q(r))
  redis.call('HDEL', INF, r)
  redis.call('HDEL', BKV, r)
  redis.call('HDEL', SEQ, r)
  redis.call('ZREM', ROUTERS, r)
end
local function sweep()
  local dead = redis.call('ZRANGEBYSCORE', ROUTERS, '-inf', '(' .. num(now), 'LIMIT', 0, 8)
  for _, r in ipairs(dead) do
    drop(r)
    redis.call('HINCRBY', ST, 'swept', 1)
    wake = true
  end
end
local function sum(key)
  local s = 0
  for _, v in ipairs(redis.call('HVALS', key)) do s = s + tonumber(v) end
  return s
end
-- the counter an arriving tenant is lifted to: the smallest among backlogged tenants, or the
-- largest of all when nobody is backlogged (vtc.virtual_floor)
local function floor_()
  local keys = redis.call('HKEYS', BL)
  if #keys > 0 then
    local m
    for _, v in ipairs(redis.call('HMGET', VC, unpack(keys))) do
      local x = tonumber(v or '0')
      if m == nil or x < m then m = x end
    end
    return m
  end
  local m = 0
  for _, v in ipairs(redis.call('HVALS', VC)) do
    local x = tonumber(v)
    if x > m then m = x end
  end
  return m
end
local function live() return redis.call('ZCARD', ROUTERS) end
-- the reply: outcome, live routers, the fleet's free slots, tenants backlogged anywhere
local function answer(ok, what, counter, free)
  return {ok, what, counter, live(), num(free), redis.call('HLEN', BL)}
end
-- slots were freed (a release, a router gone) while requests wait: wake the other routers
local function notify(free)
  if wake and (free == nil or free >= 1) and redis.call('HLEN', BL) > 0 then
    redis.call('PUBLISH', WAKE, R)
  end
end
"""
)
_STATE = r"""
sweep()
local ttl = tonumber(ARGV[4])
if ttl <= 0 then
  wake = redis.call('ZSCORE', ROUTERS, R) ~= false
  drop(R)
  notify(nil)
  return {0, 'left', '', live(), '0', 0}
end
if redis.call('ZSCORE', ROUTERS, R) == false then redis.call('HINCRBY', ST, 'joined', 1) end
redis.call('ZADD', ROUTERS, num(now + ttl), R)
local before = tonumber(redis.call('HGET', INF, R) or '0')
if tonumber(ARGV[5]) < before then wake = true end
redis.call('HSET', INF, R, ARGV[5])
redis.call('HSET', BKV, R, ARGV[6])
local cap, bkvcap, grant = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9] == '1'
local batch = tonumber(ARGV[10])
local apply = batch > tonumber(redis.call('HGET', SEQ, R) or '0')
local i = 11
local nc = tonumber(ARGV[i])
i = i + 1
for _ = 1, nc do
  local t, d = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if apply then
    local v = counter(t) + d
    if v < 0 then v = 0 end
    redis.call('HSET', VC, t, flt(v))
  end
end
if apply then redis.call('HSET', SEQ, R, num(batch)) end
local nb = tonumber(ARGV[i])
i = i + 1
local cands, listed = {}, {}
for _ = 1, nb do
  local c = {t = ARGV[i], cls = tonumber(ARGV[i + 1]), n = tonumber(ARGV[i + 2]),
             w = tonumber(ARGV[i + 3]), kv = tonumber(ARGV[i + 4]),
             since = now - tonumber(ARGV[i + 5])}
  i = i + 6
  cands[#cands + 1] = c
  listed[c.t] = true
end
for _, t in ipairs(redis.call('SMEMBERS', Q(R))) do
  if not listed[t] then unbacklog(R, t) end
end
for _, c in ipairs(cands) do
  if redis.call('SISMEMBER', Q(R), c.t) == 0 then
    if tonumber(redis.call('HGET', BL, c.t) or '0') <= 0 then
      local f = floor_()
      if f > counter(c.t) then redis.call('HSET', VC, c.t, flt(f)) end
    end
    redis.call('SADD', Q(R), c.t)
    redis.call('HINCRBY', BL, c.t, 1)
  end
  redis.call('HSET', CLS, c.t, c.cls)
  redis.call('HSET', HD(c.t), R, num(c.since))
  redis.call('PEXPIRE', HD(c.t), KEEP)
end
for _, k in ipairs({ROUTERS, INF, BKV, SEQ, BL, CLS, VC, ST, Q(R)}) do
  redis.call('PEXPIRE', k, KEEP)
end
"""

SYNC = (
    _COMMON
    + _STATE
    + r"""
local free = cap - sum(INF)
notify(free)
return answer(0, 'synced', '', free)
"""
)

ADMIT = (
    _COMMON
    + _STATE
    + r"""
local free = cap - sum(INF)
local function refuse(reason)
  notify(free)
  return answer(0, reason, '', free)
end
if not grant then return refuse('synced') end
if nb == 0 then return refuse('idle') end
if free < 1 then return refuse('full') end
-- the smallest counter per class among every router's backlogged tenants
local keys = redis.call('HKEYS', BL)
local least = {}
if #keys > 0 then
  local vcs = redis.call('HMGET', VC, unpack(keys))
  local cls = redis.call('HMGET', CLS, unpack(keys))
  for j = 1, #keys do
    local k, v = tonumber(cls[j] or '0'), tonumber(vcs[j] or '0')
    if least[k] == nil or v < least[k] then least[k] = v end
  end
end
for _, c in ipairs(cands) do c.v = counter(c.t) end
table.sort(cands, function(a, b)
  if a.cls ~= b.cls then return a.cls < b.cls end
  if a.v ~= b.v then return a.v < b.v end
  return a.t < b.t
end)
-- this router's fairest tenant goes only when it is the fleet's fairest too (interactive first)
local c = cands[1]
if c.cls == 1 and least[0] ~= nil then return refuse('priority') end
local low = least[c.cls] or c.v
if c.v > low + 1e-9 * math.max(1, math.abs(low)) then return refuse('turn') end
-- one FIFO per tenant across routers: the router holding its oldest head goes first
for _, x in ipairs(redis.call('HVALS', HD(c.t))) do
  if tonumber(x) + ORDER_MS < c.since then return refuse('order') end
end
if c.cls == 1 then
  local held = sum(BKV)
  if held > 0 and c.kv > bkvcap - held then return refuse('batch_kv') end
  redis.call('HINCRBY', BKV, R, num(c.kv))
end
redis.call('HINCRBY', INF, R, 1)
local v = c.v + c.w
redis.call('HSET', VC, c.t, flt(v))
if c.n <= 1 then
  unbacklog(R, c.t)
else
  redis.call('HSET', HD(c.t), R, num(now))  -- its next head's age comes with the next call
end
redis.call('HINCRBY', ST, 'granted', 1)
notify(free - 1)
return answer(1, c.t, flt(v), free - 1)
"""
)

# ARGV: 1 key prefix, 2 now. Reply: flat lists {routers (id, expiry ms), in-flight (id, n),
# batch KV (id, tokens), backlogged (tenant, routers), counters (tenant, value), stats}.
VIEW = (
    _COMMON
    + r"""
sweep()
notify(nil)
return {redis.call('ZRANGE', ROUTERS, 0, -1, 'WITHSCORES'), redis.call('HGETALL', INF),
        redis.call('HGETALL', BKV), redis.call('HGETALL', BL), redis.call('HGETALL', VC),
        redis.call('HGETALL', ST)}
"""
)

__all__ = ["ADMIT", "SYNC", "VIEW"]
