"""The Lua scripts of the Redis store: each is one atomic transition (see redis_store.py for the key layout).

Every script is idempotent (absolute counter values, set operations, XCLAIM, an id index checked first), so
a call whose reply was lost is simply run again. Group payloads never pass through a script (see P:data).
"""

# KEYS: stream, ids, meta.  ARGV: group, consumer, k, then k x (gid, min version, samples, tokens), meta pairs
PUT = """
local k = tonumber(ARGV[3])
local out = {}
for i = 0, k - 1 do
  local b = 4 + 4 * i
  local sid = redis.call('HGET', KEYS[2], ARGV[b])
  if not sid then
    sid = redis.call('XADD', KEYS[1], '*', 'g', ARGV[b], 'v', ARGV[b + 1], 'n', ARGV[b + 2], 't', ARGV[b + 3])
    redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
    redis.call('HSET', KEYS[2], ARGV[b], sid)
  end
  out[i + 1] = sid
end
if #ARGV > 3 + 4 * k then redis.call('HSET', KEYS[3], unpack(ARGV, 4 + 4 * k)) end
return out
"""

# KEYS: stream, ids, meta.  ARGV: group, gid, old sid, min version, samples, tokens, meta pairs
REWARD = """
local sid = redis.call('HGET', KEYS[2], ARGV[2])
if sid ~= ARGV[3] then return sid end
sid = redis.call('XADD', KEYS[1], '*', 'g', ARGV[2], 'v', ARGV[4], 'n', ARGV[5], 't', ARGV[6])
redis.call('XREADGROUP', 'GROUP', ARGV[1], '_held', 'COUNT', 1, 'STREAMS', KEYS[1], '>')
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], sid)
if #ARGV > 6 then redis.call('HSET', KEYS[3], unpack(ARGV, 7)) end
return sid
"""

# ARGV: group, consumer, k, sid_1..sid_k, gid_1..gid_k, deliv_1..deliv_k, meta pairs...
DELIVER = """
local k = tonumber(ARGV[3])
if k > 0 then
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for i = 1, k do args[5 + i] = ARGV[3 + i] end
  args[6 + k] = 'JUSTID'
  redis.call(unpack(args))  -- (unpack must come last in a call: Lua truncates it to one value otherwise)
  for i = 1, k do redis.call('HSET', KEYS[2], ARGV[3 + k + i], ARGV[3 + 2 * k + i]) end
end
if #ARGV > 3 + 3 * k then redis.call('HSET', KEYS[3], unpack(ARGV, 4 + 3 * k)) end
return k
"""

# KEYS: stream, ids, deliv, final (trained set | dropped hash), meta, data
# ARGV: group, reason ('' = trained), k, sid_1..sid_k, gid_1..gid_k, meta pairs...
FINISH = """
local k = tonumber(ARGV[3])
if k > 0 then
  local sids = {unpack(ARGV, 4, 3 + k)}
  local gids = {unpack(ARGV, 4 + k, 3 + 2 * k)}
  redis.call('XACK', KEYS[1], ARGV[1], unpack(sids))
  redis.call('XDEL', KEYS[1], unpack(sids))
  redis.call('HDEL', KEYS[2], unpack(gids))
  redis.call('HDEL', KEYS[3], unpack(gids))
  redis.call('HDEL', KEYS[6], unpack(gids))
  if ARGV[2] == '' then
    redis.call('SADD', KEYS[4], unpack(gids))
  else
    for i = 1, k do redis.call('HSET', KEYS[4], gids[i], ARGV[2]) end
  end
end
if #ARGV > 3 + 2 * k then redis.call('HSET', KEYS[5], unpack(ARGV, 4 + 2 * k)) end
return k
"""

# KEYS: admits hash, admit order list, meta.  ARGV: request id, "granted version", keep, meta pairs...
ADMIT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  while redis.call('LLEN', KEYS[2]) > tonumber(ARGV[3]) do redis.call('HDEL', KEYS[1], redis.call('RPOP', KEYS[2])) end
end
if #ARGV > 3 then redis.call('HSET', KEYS[3], unpack(ARGV, 4)) end
return 1
"""

META = """
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
